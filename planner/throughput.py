"""Analytical step time of one fine-tuning configuration on one device model.

One optimizer step = ``grad_accum`` micro-steps of ``micro_batch x seq_len`` tokens on each of
``config.gpus`` devices, then one optimizer update. The step time is the SUM of named parts (no
overlap assumed; conservative, and each part can be calibrated on its own):

* ``compute``     linear-layer GEMMs (+ output head, + LoRA adapters), forward and backward, each
                  on the roofline of its shape (``planner.kernels``)
* ``attention``   attention's products at the kernel's rate (flash/SDPA skip the causal half)
* ``recompute``   the GEMMs and attention of gradient checkpointing's second forward
* ``elementwise`` norms, activations, rotary, residuals, dropout, casts, the loss and eager
                  attention's scores, at achieved memory bandwidth
* ``dequant``     QLoRA's 4-bit -> 16-bit weight dequantisation (memory bound)
* ``optimizer``   the optimizer update (memory bound on the device, or its host dispatch where that is
                  longer: a per-tensor optimizer's ops, ``_step_dispatch``; or DeepSpeed's CPU Adam; on the
                  CPU torch.optim.AdamW's single-tensor path, its host time per tensor and the page faults
                  of its temporaries)
* ``overhead``    the device's gap per kernel; the host's dispatch where it outlasts a micro-step's
                  kernels (the step takes max(device, host): small models, short micro-batches); on
                  the CPU every op's host time
* ``comm``        gradient reduction and ZeRO parameter gathers between devices
* ``offload``     host<->device copies of ZeRO-Offload

On the CPU profile the ``elementwise`` part also holds the page faults of the tensors past glibc's
mmap threshold (``planner.kernels.MMAP_THRESHOLD_BYTES``) that c10's CPU allocator maps afresh
each micro-step (``fresh_bytes``: the logits', and under full fine-tuning the weight gradients and
AMP's weight copies): with the single-tensor AdamW they are what makes a small model with a large
vocabulary slow there.

FLOP counts follow Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", sec. 2.1:
2N forward, 4N backward per token) and the attention term of Chowdhery et al. 2022 (PaLM,
appendix B: 6N + 12·L·H·Q·T training FLOPs per token, i.e. 4·L·T·H·Q forward): the model FLOPs
an MFU is quoted against. The step itself is priced kernel by kernel (``planner.kernels``): a large
GEMM runs at ``peak_tflops(precision) x utilization``, where the utilization is the device's
achieved large-GEMM fraction (its MAMF; ``planner calibrate`` fits it from a user's runs), skinny
GEMMs and elementwise work at the device bandwidth x ``MEMORY_BANDWIDTH_EFFICIENCY``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from planner.config import Attention, Method, Precision, TrainConfig
from planner.errors import InvalidConfigError
from planner.gpus import GPUSpec, check_precision, matmul_dtype
from planner.kernels import (
    ADAPTER_OUT_FORWARD_BYTES,
    ADAMW_SINGLE_TENSOR_PASSES,
    CPU_ADAMW_TENSOR_SECONDS,
    CPU_AUTOCAST_OP_SECONDS,
    CPU_BANDWIDTH_FRACTION,
    CPU_FIRST_TOUCH_SECONDS_PER_BYTE,
    CPU_FLASH_FRACTION_OF_GEMM,
    CPU_MATH_FRACTION_OF_GEMM,
    CPU_OP_SECONDS,
    CUDA_OP_HOST_SECONDS,
    GPU_OP_SECONDS,
    MMAP_THRESHOLD_BYTES,
    OPTIMIZER_OP_HOST_SECONDS,
    FUSED_BACKWARD_FLOPS,
    DeviceRates,
    MicroTerms,
    PricedTerms,
    attention_flops,
    block_weights,
    casts_weights,
    cpu_sdpa_math,
    fp8_seconds,
    fp8_work,
    fp32_adapters,
    gemm_seconds,
    host_excess,
    host_op_seconds,
    matmul_fraction,
    micro_terms,
    ops_per_micro_step,
    price,
    rows_per_token,
    weight_cast_bytes,
)
from planner.memory.dtypes import ADAPTER_BYTES, NF4_READ_BYTES, nf4_packed_bytes
from planner.memory.parameters import param_tensor_sizes, quantized_linear_params, stack_targets, trainable_params
from planner.memory.shapes import drops_adapter_inputs
from planner.modelspec import ModelSpec
from planner.moe_loop import SYNC_DRAIN_OPS, list_index_host, loop_syncs
from planner.optim import OPTIMIZERS
from planner.optim.adamw import SINGLE_TENSOR_OPS, AdamWMemory
from planner.results import ThroughputEstimate
from planner.sharding.fsdp1_host import (
    CLONE_PASSES,
    LAYER_KINDS,
    NORM_PASSES,
    Layer,
)

# ---- stated assumptions (calibrate with measurements) ----------------------------------------

#: Fraction of the datasheet memory bandwidth an elementwise kernel reaches (STREAM-like kernels
#: reach 80-90% of HBM/GDDR peak).
MEMORY_BANDWIDTH_EFFICIENCY = 0.80
#: Host DRAM bandwidth one rank's DeepSpeed CPU Adam gets: one socket of 8-channel DDR4-3200 has
#: 204.8 GB/s raw, shared by up to 8 ranks on a GPU server => ~25 GB/s each.
HOST_DRAM_GBS_PER_RANK = 25.0
#: DeepSpeed CPU Adam bytes per parameter (csrc/adam/cpu_adam_impl.cpp): read fp32 param, grad,
#: exp_avg, exp_avg_sq (16 B), write param, exp_avg, exp_avg_sq (12 B); +2 B for the 16-bit copy
#: of the updated parameter sent back to the device (mixed precision only).
CPU_ADAM_BYTES_PER_PARAM = 28
CPU_ADAM_HALF_COPY_BYTES = 2

#: Fraction of NVLink's line rate a collective moves payload at: an NVLink packet carries at most
#: 128 B of payload from the SMs NCCL's kernels copy with, so each link's 25 GB/s line rate gives
#: ~20 GB/s ("Each NVLink has a line rate of 25GB/s (in each direction) which converts to ~20GB/s
#: effective bandwidth with a 128B payload size"; on A100 "240GB/s ... some other bottlenecks on the
#: GPUs limits it to ~230GB/s": NCCL's lead, NVIDIA/nccl-tests issue #149, 2023-07-05; "the
#: app-level bandwidth is 80% of the peak bandwidth", NVIDIA/nccl issue #1054, whose src/graph/topo.h
#: counts an NVLink at 20 GB/s). H100: "450GB/s is the line rate. With the protocol overhead (~20%)
#: NCCL can get an effective NVLink bandwidth of 370GB/s" (NVIDIA/nccl-tests issue #212, 2024-05-06).
#: The catalog's NVLink rates are line rates (``planner.gpus``); its PCIe rates are effective already.
NVLINK_PAYLOAD_FRACTION = 0.80

#: NF4 weights read per weight: ``planner.memory.dtypes.NF4_READ_BYTES`` (0.5 B plus the block
#: constants with double quantisation, QLoRA paper sec. 3).
#: bitsandbytes' Linear4bit dequantises the whole weight to the 16-bit compute dtype before the
#: matmul, forward and backward (bitsandbytes/autograd/_functions.py MatMul4Bit: dequantize_4bit
#: in forward and again in backward for grad_input), writing 2 B per weight.
DEQUANT_WRITE_BYTES = 2

@dataclass(frozen=True, kw_only=True)
class FlopsPerToken:
    """Matmul FLOPs per token on one device, by part of the step."""

    linear: float
    """Linear layers + output head (+ LoRA adapters), forward and backward."""
    attention: float
    """Attention scores (QK^T) and weighted values (PV), forward and backward."""
    recompute: float
    """Gradient checkpointing's second forward of every decoder layer (0 without it)."""

    @property
    def model(self) -> float:
        """Model FLOPs (the MFU convention: recomputation is not counted)."""
        return self.linear + self.attention


# ---- model facts -----------------------------------------------------------------------------


def _layer_matmul_weights(model: ModelSpec) -> int:
    """Weights every token multiplies in the blocks (no biases): the active experts, or every
    expert where the stack runs over every token (Llama 4: ``planner.kernels.rows_per_token``,
    its expert GEMM FLOPs scale with the experts). An encoder-decoder's target is as long as its source (``planner.memory.encdec``), so per source
    token both stacks count: the encoder's blocks for the source token, the decoder's (self- and
    cross-attention projections and MLP) for the target token."""
    return sum(n * sum(rows_per_token(model, lin) * lin.in_features * lin.out_features for lin in linears)
               for n, linears in model.all_blocks)


def _attention_layers(model: ModelSpec) -> int:
    """Attention products per token: one per block, plus the decoder's cross-attention (its
    scores are target x source, the same size when the lengths are equal)."""
    return model.num_layers + 2 * model.decoder_layers


def _attention_context(model: ModelSpec, seq_len: int) -> int:
    """Keys each query attends to: the sequence, or the sliding window when shorter."""
    return min(seq_len, model.sliding_window) if model.sliding_window else seq_len


def flops_per_token(*, model: ModelSpec, config: TrainConfig) -> FlopsPerToken:
    """Training matmul FLOPs per token.

    Forward: 2 FLOPs per weight of every linear layer and of the vocab projection (an embedding
    lookup costs none), plus 4·T·H·Q per layer for QK^T and PV (PaLM appendix B). Causal masking
    is NOT halved here: these are the model FLOPs published MFU figures count (the step's time
    halves them where the kernel skips the masked half: ``planner.kernels.attention_seconds``).
    Backward: full fine-tuning 2x forward (activation + weight gradients; Kaplan 2020). LoRA/QLoRA:
    the frozen base weights need activation gradients only (1x forward), the adapters both (2x).
    Attention has no weights; its backward is 2x forward either way (dQ, dK, dV, dP).
    Checkpointing: one more forward of every decoder layer (not of the output head).
    """
    n_layers = _layer_matmul_weights(model)
    n_head = model.lm_head_params
    attention_forward = 4 * _attention_layers(model) * _attention_context(model, config.seq_len) * model.num_heads * model.head_dim
    if config.method is Method.FULL:
        adapter = 0
        linear = 6 * (n_layers + n_head)
    else:
        r = config.lora_r
        assert r is not None
        adapter = sum(n * sum(lin.active * r * (lin.in_features + lin.out_features) for lin in linears)
                      for n, linears in stack_targets(model, config.lora_targets))
        linear = 4 * (n_layers + n_head) + 6 * adapter
    recompute = 2 * (n_layers + adapter) + attention_forward if config.grad_ckpt else 0
    return FlopsPerToken(linear=float(linear), attention=float(3 * attention_forward), recompute=float(recompute))


# ---- bytes moved -----------------------------------------------------------------------------


def _trainable_bytes(config: TrainConfig) -> int:
    """Bytes per element of trainable weights, their gradients and torch optimizer states as the
    update reads them: fp32 adapters (``planner.memory.dtypes.ADAPTER_BYTES``), else the
    precision's weights (DeepSpeed's fp32 master partition under mixed precision)."""
    return ADAPTER_BYTES if config.method.uses_adapters else config.precision.weight_bytes


def optimizer_bytes_per_param(*, config: TrainConfig) -> float:
    """Device memory traffic of one optimizer update per trainable parameter.

    Each optimizer's own traffic is its memory model's ``update_bytes_per_param`` in its
    descriptor (``planner.optim``; AdamW 7w: the fused kernel reads param, grad and both moments
    and writes three, and ``_update_bytes_per_param`` prices the unfused paths a device takes; 8-bit AdamW 3w + 4·(1 + 4/256); SGD 5w;
    Adafactor 16 fp32 passes). The sharding scheme adds its own (``ShardingSpec.master_update_bytes``;
    ZeRO's fp32 master copy under 16-bit training: +4 B read of the master, +2 B write of the
    16-bit model weight).
    """
    per_param = OPTIMIZERS[config.optimizer].memory.update_bytes_per_param(_trainable_bytes(config))
    extra = config.sharding.spec.master_update_bytes(config)
    if extra:
        per_param += extra
    return per_param


def comm_bytes_per_step(*, model: ModelSpec, config: TrainConfig) -> float:
    """Bytes each device sends over the interconnect per optimizer step (ring collectives): the
    sharding scheme's collectives (``ShardingSpec.comm_bytes``: DDP's gradient all-reduce,
    ZeRO's reduce-scatters and all-gathers, each with its source)."""
    quantized = _quantized_weights(model) if config.method is _QLORA else 0
    return _comm_bytes(config, trainable_params(model, config), model.params_total, quantized)


def _comm_bytes(config: TrainConfig, trainable: int, params_total: int, quantized: int = 0) -> float:
    if config.gpus == 1:
        return 0.0
    spec = config.sharding.spec
    if quantized and config.method is _QLORA and spec.shards_4bit:  # (FSDP gathers the packed 4-bit weights)
        return spec.comm_bytes(config, trainable=trainable, params_total=params_total,
                               grad_bytes=_trainable_bytes(config), quantized=quantized,
                               packed=nf4_packed_bytes(quantized))
    return spec.comm_bytes(config, trainable=trainable, params_total=params_total,
                           grad_bytes=_trainable_bytes(config))


def offload_bytes_per_step(*, model: ModelSpec, config: TrainConfig) -> float:
    """Host<->device bytes per optimizer step per device of what the sharding scheme offloads
    (``ShardingSpec.offload_bytes``: ZeRO-Offload's gradient and parameter copies)."""
    if not config.sharding.offloaded:
        return 0.0
    return _offload_bytes(config, trainable_params(model, config), model.params_total)


def _offload_bytes(config: TrainConfig, trainable: int, params_total: int) -> float:
    sharding = config.sharding
    if not sharding.offloaded:
        return 0.0
    return sharding.spec.offload_bytes(config, sharding.offload, trainable=trainable, params_total=params_total)


def paging_bytes_per_step(paged_host: int) -> int:
    """Host<->device bytes per optimizer step of a paged optimizer's states the device has no room
    for (``MemoryEstimate.paged_host_bytes``): each is migrated in when bitsandbytes prefetches it
    for its update and out again when the allocator or the next state needs the room
    (``planner.memory.overhead.paged_on_host``), serially: bitsandbytes synchronises after every
    parameter's update (bitsandbytes/optim/optimizer.py ``step``: ``sync_gpu(p)``)."""
    return 2 * paged_host


def _with_paging(parts: tuple[float, ...], paged_host: int, rates: _Rates) -> tuple[float, ...]:
    """``parts`` (of ``PARTS``) with the paging traffic in the offload part, at the host link's rate."""
    if not paged_host:
        return parts
    return (*parts[:-1], parts[-1] + paging_bytes_per_step(paged_host) / rates.host_link_bw)


def _quantized_weights(model: ModelSpec) -> int:
    """Weights stored in 4 bits under QLoRA: the memory model's (``planner.memory.parameters.quantized_linear_params``:
    the weights of every block nn.Linear, transformers 4's per-expert modules
    among them; not transformers 5's 3D expert stacks or routers, which bitsandbytes leaves in the load dtype, so
    they are neither dequantised nor gathered packed), without their biases (Linear4bit keeps its bias 16-bit). The
    output head stays 16-bit (transformers skips lm_head)."""
    return quantized_linear_params(model)


def _dequant_bytes(config: TrainConfig, quantized: int) -> float:
    if config.method is not _QLORA:
        return 0.0
    # Every stored 4-bit weight is dequantised per call: forward, backward and the checkpoint
    # recompute.
    passes = 2 + int(config.grad_ckpt)
    return quantized * (NF4_READ_BYTES + DEQUANT_WRITE_BYTES) * passes * config.grad_accum


# ---- the estimate ----------------------------------------------------------------------------


def default_utilization(*, gpu: GPUSpec, precision: Precision | str) -> float:
    """The large-GEMM efficiency for a device and precision (the fraction of the peak a large
    square-ish GEMM reaches; smaller ones fall below it on the roofline): the device's calibrated
    one (``planner calibrate``, ``GPUSpec.mfu``) where it has one, else its published MAMF
    fraction (``planner.kernels.matmul_fraction``)."""
    calibrated = gpu.mfu.get(matmul_dtype(precision))
    if calibrated is not None:
        return calibrated
    return matmul_fraction(gpu, Precision(precision))


def bandwidth_efficiency(gpu: GPUSpec) -> float:
    """Fraction of the datasheet bandwidth memory-bound kernels reach: the device's calibrated
    one where it has one, else ``MEMORY_BANDWIDTH_EFFICIENCY`` (the CPU's measured rate: ``CPU_BANDWIDTH_FRACTION``)."""
    default = CPU_BANDWIDTH_FRACTION if gpu.is_cpu else MEMORY_BANDWIDTH_EFFICIENCY
    return default if gpu.bandwidth_efficiency is None else gpu.bandwidth_efficiency


def _utilization(gpu: GPUSpec, precision: Precision, utilization: float | None) -> float:
    if utilization is None:
        return default_utilization(gpu=gpu, precision=precision)
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise InvalidConfigError(f"utilization must be a fraction in (0, 1], got {utilization!r}")
    return utilization


#: The parts of a step, in the order ``step_breakdown`` lists them (and the search sums them).
PARTS = ("compute", "attention", "recompute", "elementwise", "dequant", "optimizer", "overhead", "comm", "offload")
#: The parts the micro-steps' kernels (and their gaps) fill: what the host's dispatch bounds below.
_MICRO_PARTS = PARTS[:4] + ("overhead",)

#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and the search reads these thousands of times a search
_QLORA, _FP8 = Method.QLORA, Precision.FP8
_NO_HOST = (0.0, 0.0, 0.0)  # a GPU's host terms (``_host_terms``)


class _Rates(NamedTuple):
    """The rates one device gives one precision, each the divisor of a part of the step (a tuple:
    ``step_breakdown`` makes one per call)."""

    kernels: DeviceRates
    """Achieved GEMM FLOP/s, device bandwidth and host time per op (``planner.kernels``)."""
    host_bw: float
    """Bytes/s of host DRAM one rank's DeepSpeed CPU Adam gets."""
    link_bw: float
    """Bytes/s each device sends over the interconnect."""
    host_link_bw: float
    """Bytes/s between host and device."""
    first_touch: float = 0.0
    """Seconds per byte of a fresh tensor the allocator maps in again each step (the CPU profile's, for
    tensors of at least ``MMAP_THRESHOLD_BYTES``; 0 on the GPUs, whose caching allocator keeps its blocks)."""

    @property
    def device_bw(self) -> float:
        return self.kernels.bandwidth


def _op_seconds(gpu: GPUSpec, precision: Precision) -> float:
    """Host seconds per eager op the device waits for: on the CPU the host runs the kernels itself, so every
    op's dispatch, module and autograd bookkeeping adds (more ops under autocast: its casts); on a GPU the
    launch-to-launch gap (``planner.kernels``)."""
    if not gpu.is_cpu:
        return GPU_OP_SECONDS
    return CPU_AUTOCAST_OP_SECONDS if precision.is_mixed else CPU_OP_SECONDS


def _rates(gpu: GPUSpec, precision: Precision, utilization: float | None) -> _Rates:
    return _Rates(
        kernels=DeviceRates(
            gemm=gpu.peak_tflops(precision) * 1e12 * _utilization(gpu, precision, utilization),
            bandwidth=gpu.mem_bandwidth_gbs * 1e9 * bandwidth_efficiency(gpu),
            op_seconds=_op_seconds(gpu, precision),
        ),
        # DeepSpeed CPU Adam at host DRAM speed (on the CPU profile the host is the device itself)
        host_bw=(gpu.mem_bandwidth_gbs if gpu.is_cpu else HOST_DRAM_GBS_PER_RANK) * 1e9,
        link_bw=link_gbs(gpu) * 1e9,
        host_link_bw=gpu.host_link_gbs * 1e9,
        first_touch=CPU_FIRST_TOUCH_SECONDS_PER_BYTE if gpu.is_cpu else 0.0,
    )


def link_gbs(gpu: GPUSpec) -> float:
    """GB/s per direction a collective moves between two devices: NVLink's line rate less its packet
    overhead (``NVLINK_PAYLOAD_FRACTION``); the catalog's other links are effective rates already
    (``planner.gpus``: PCIe at ~80% of raw)."""
    return gpu.interconnect_gbs * (NVLINK_PAYLOAD_FRACTION if gpu.interconnect.startswith("nvlink") else 1.0)


def _adamw_path(gpu: GPUSpec, config: TrainConfig) -> str | None:
    """The torch.optim.AdamW path the device steps with (``KernelProfile.adamw``), or None where the
    optimizer is not torch's AdamW on the device (another optimizer; DeepSpeed's CPU Adam under
    offload). The planner's runs build torch.optim.AdamW with no ``fused``/``foreach`` argument (HF's
    ``adamw_torch``, the descriptor's ``hf_optim``; the worker's ``build``), and torch then takes the
    foreach path wherever every parameter is on a CUDA device, never the fused kernel unless asked
    (torch/optim/optimizer.py ``_default_to_fused_or_foreach``: ``fused = use_fused and ...``), and
    the single-tensor loop on the CPU. HF's own default became ``adamw_torch_fused`` for torch >= 2.8
    (transformers training_args.py ``default_optim``), but an emitted plan names ``adamw_torch``."""
    memory = OPTIMIZERS[config.optimizer].memory
    if config.sharding.offloaded or not isinstance(memory, AdamWMemory):
        return None
    return str(memory.path_on(gpu.kernels))


def _cpu_adamw(gpu: GPUSpec, config: TrainConfig) -> str | None:
    """``_adamw_path`` on the CPU profile (its page faults and per-tensor host time), None elsewhere."""
    return _adamw_path(gpu, config) if gpu.is_cpu else None


def _update_bytes_per_param(config: TrainConfig, gpu: GPUSpec) -> float:
    """Bytes the optimizer update moves per trainable parameter: DeepSpeed's CPU Adam on the host
    under offload, else ``optimizer_bytes_per_param`` on the device; the CPU's unfused AdamW
    makes 20 element passes, not 7, and so does the foreach path a GPU steps with
    (``planner.kernels.ADAMW_SINGLE_TENSOR_PASSES``)."""
    if config.sharding.offloaded:
        return CPU_ADAM_BYTES_PER_PARAM + (CPU_ADAM_HALF_COPY_BYTES if config.precision.is_mixed else 0)
    per_param = optimizer_bytes_per_param(config=config)
    if _adamw_path(gpu, config) in ("single_tensor", "foreach"):  # the foreach path runs the same passes
        # in place of the fused kernel's passes, which AdamW's descriptor prices (planner.optim.adamw)
        w = _trainable_bytes(config)
        per_param += ADAMW_SINGLE_TENSOR_PASSES * w - OPTIMIZERS[config.optimizer].memory.update_bytes_per_param(w)
    return per_param


def _big(nbytes: float) -> float:
    return nbytes if nbytes >= MMAP_THRESHOLD_BYTES else 0.0


def _weight_tensors(model: ModelSpec) -> list[int]:
    """Elements of each weight matrix a forward multiplies by: the blocks' linears as stored (an expert
    stack one tensor) and the output head (the embedding itself when tied)."""
    sizes = []
    for n, linears in model.all_blocks:
        for lin in linears:
            one = [lin.in_features * lin.out_features] * lin.count if lin.module else [lin.count * lin.in_features * lin.out_features]
            sizes += one * n
    if model.lm_head_params:
        sizes.append(model.lm_head_params)
    return sizes


def fresh_bytes(*, model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> tuple[float, float]:
    """(per micro-step, per optimizer step) bytes of tensors of at least ``MMAP_THRESHOLD_BYTES`` made afresh
    on a device whose allocator hands them back (the CPU profile; 0 on the GPUs), each page-faulted in at first
    touch. Per micro-step: the logits' tensors (the head's output, transformers' ``logits.float()``, the loss's
    log-softmax; backward the nll and log-softmax gradients and the cast back), and under full fine-tuning each
    weight's new gradient (autograd makes one per backward; under torch AMP the 16-bit copy autocast makes, its
    16-bit gradient and the fp32 cast of it); a 16-bit matmul's fp32 output buffer beside the logits and each
    weight gradient (``KernelProfile.mm_fp32_buffer``) and the embedding's dense gradient (plus the sum of the two
    partials when the head is tied to it). Per step: the single-tensor AdamW's two temporaries (``sqrt``,
    ``/``) per parameter, one on the foreach path."""
    if not gpu.is_cpu:
        return 0.0, 0.0
    elem = config.precision.compute_bytes
    # where the CPU's bf16 matmul computes into an fp32 buffer of its output's size (KernelProfile.mm_fp32_buffer:
    # AMX CPUs, planner.gpus.bf16_matmul_fp32_buffer): the head's logits forward and, trained, each weight gradient
    buffer = elem < 4 and gpu.kernels.mm_fp32_buffer
    micro = 0.0
    if model.lm_head_params and config.full_logits:
        logit_bytes = [elem, 4, 4, 4] if elem == 4 else [elem, 4, 4, 4, 4, elem] + ([4] if buffer else [])
        logits = config.micro_batch * config.seq_len * model.vocab_size
        micro += sum(_big(logits * b) for b in logit_bytes)
    if config.method is Method.FULL:
        w = config.precision.weight_bytes
        grad = [2, 2, 4] if casts_weights(config) else [w]
        if buffer:
            grad.append(4)
        micro += sum(_big(size * b) for size in _weight_tensors(model) for b in grad)
        table = model.vocab_size * model.hidden_size
        micro += _big(table * w) * (2 if model.tied_embeddings else 1)
    step = 0.0
    path = _cpu_adamw(gpu, config)
    if path in ("single_tensor", "foreach"):
        copies = 2 if path == "single_tensor" else 1
        step = copies * sum(_big(size * _trainable_bytes(config)) for size in param_tensor_sizes(model, config))
    return micro, step


def _optimizer_host_s(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> float:
    """Host seconds of the CPU's AdamW step: its single-tensor path's ops per tensor
    (``planner.optim.adamw.SINGLE_TENSOR_OPS``) at ``planner.kernels.OPTIMIZER_OP_HOST_SECONDS`` each, its foreach and
    fused paths at their measured seconds per tensor (``CPU_ADAMW_TENSOR_SECONDS``)."""
    path = _cpu_adamw(gpu, config)
    if path is None:
        return 0.0
    per_tensor = CPU_ADAMW_TENSOR_SECONDS.get(path, SINGLE_TENSOR_OPS.ops * OPTIMIZER_OP_HOST_SECONDS)
    return per_tensor * len(param_tensor_sizes(model, config))


def _trainable_matrices(model: ModelSpec, config: TrainConfig) -> int:
    """Trainable tensors of two or more dimensions (of ``param_tensor_sizes``): every LoRA factor, else the
    embedding tables, the blocks' weights and an untied head (biases and norms are 1-D)."""
    if config.method.uses_adapters:
        return len(param_tensor_sizes(model, config))
    tables = 1 + (2 if model.is_encoder_decoder else 1 if model.other_embedding_params else 0)
    weights = sum(n * sum(lin.count for lin in linears) for n, linears, _ in model.block_tensors)
    return tables + weights + (1 if model.head_params else 0)


#: no host dispatch priced for the optimizer step (``_step_dispatch``): (seconds, serial)
_NO_STEP_DISPATCH = (0.0, False)


def _step_dispatch(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> tuple[float, bool]:
    """(host seconds, whether they add to the device's) of a GPU's optimizer step: the ops its descriptor counts
    over the trainable tensors (``OptimizerModel.step_ops``) at ``planner.kernels.OPTIMIZER_OP_HOST_SECONDS`` each,
    + ``CUDA_OP_HOST_SECONDS`` for each that launches a kernel, from one Python thread after GradScaler's or the
    loop's sync has drained the queue: the update takes the longer of its device bytes and this, or their sum where the optimizer waits for the
    device after each tensor (``OptimizerModel.syncs_each_tensor``). Not counted on the CPU profile (its
    ``_optimizer_host_s``), under offload (DeepSpeed's CPU Adam) and where the scheme steps partitions of its own."""
    if gpu.is_cpu or config.sharding.offloaded or config.sharding.spec.partitions_optimizer:
        return _NO_STEP_DISPATCH
    memory = OPTIMIZERS[config.optimizer].memory
    tensors = len(param_tensor_sizes(model, config))
    ops = memory.step_ops(tensors, _trainable_matrices(model, config), _trainable_bytes(config), gpu.kernels)
    return ops.ops * OPTIMIZER_OP_HOST_SECONDS + ops.launches * CUDA_OP_HOST_SECONDS, memory.syncs_each_tensor


def fsdp1_decoder_layer(model: ModelSpec, config: TrainConfig, gpu: GPUSpec, base_host: tuple[float, float]) -> Layer | None:
    """The ``Layer`` of FSDP1's rate-limiter timeline (``planner.sharding.fsdp1_host``) for one of the
    model's decoder layers on ``gpu`` at ``config``'s micro-batch: its linears' GEMMs (and each 4-bit
    weight's dequantisation under QLoRA) at the planner's large-GEMM and memory rates
    (``planner.kernels.gemm_seconds``), attention's forward FLOPs (``attention_flops``), each
    adapter's rank-r GEMMs and output passes; ``base_host``: (forward, backward) host seconds of a dense
    base linear's call (an expert's are the expert loop's, ``planner.moe_loop``). None for a layer whose
    order it does not know (one kind of block with q, k, v, o and an MLP)."""
    blocks = stack_targets(model, config.lora_targets)
    if len(model.all_blocks) != 1 or any(lin.kind not in LAYER_KINDS for lin in model.layer_linears):
        return None
    kinds = [lin.kind for lin in model.layer_linears]
    if "attn_out" not in kinds:
        return None
    rates = _rates(gpu, config.precision, None).kernels  # the device's default rates
    tokens, elem = config.micro_batch * config.seq_len, 2
    quantized = config.method.value == "qlora"
    adapted = {lin.name for lin in blocks[0][1]}
    linears = []
    for lin in model.layer_linears:
        # a dense base's call; an expert's are the expert loop's (planner.moe_loop), priced there
        host = base_host if lin.count == 1 and lin.module else (0.0, 0.0)
        rows = tokens * lin.active
        base = gemm_seconds(rows, lin.out_features, lin.in_features, rates=rates, elem=elem)
        if quantized:
            base += lin.count * lin.in_features * lin.out_features * (NF4_READ_BYTES + DEQUANT_WRITE_BYTES) / rates.bandwidth
        adapter = None
        if lin.name in adapted and lin.count == 1:
            r = config.lora_r * lin.lora_rank
            out_bytes = ADAPTER_OUT_FORWARD_BYTES + (CLONE_PASSES * elem if quantized else 0)  # per output element
            adapter = (gemm_seconds(tokens, r, lin.in_features, rates=rates, elem=elem)
                       + gemm_seconds(tokens, lin.out_features, r, rates=rates, elem=elem)
                       + out_bytes * tokens * lin.out_features / rates.bandwidth)
        linears.append((base, adapter, *host))
    return Layer(linears=tuple(linears), attention_at=kinds.index("attn_out"),
                 attention=attention_flops(model, config, tokens, gpu)[1] / model.num_layers / rates.gemm,
                 attention_backward=FUSED_BACKWARD_FLOPS,
                 small=NORM_PASSES * tokens * model.hidden_size * elem / rates.bandwidth,
                 op_host=host_op_seconds(gpu, config))


def _scheme_host_s(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> float:
    """Host seconds per step the sharding scheme's units add on the step's path (``ShardingSpec.host_seconds``:
    FSDP1's adapter units), on more than one GPU; 0.0 for a scheme without (``ShardingSpec.unit_host``)."""
    spec = config.sharding.spec
    if not spec.unit_host or config.gpus == 1:
        return 0.0
    adapted = sum(n * sum(lin.count for lin in linears if lin.module)
                  for n, linears in stack_targets(model, config.lora_targets)) if config.method.uses_adapters else 0
    layer_of = None if gpu.is_cpu else partial(fsdp1_decoder_layer, model, config, gpu)
    return spec.host_seconds(model, config, adapted_modules=adapted, layer_of=layer_of)


def _loop_drain_s(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> float:
    """Seconds per step the device waits for the host after the syncs of transformers 4's expert loop
    (``planner.moe_loop.loop_syncs``), each until the host has dispatched ``SYNC_DRAIN_OPS`` ops at its host time
    per op (``planner.kernels.host_op_seconds``; 0.0 on the CPU profile: no queue), and where the loop indexes with
    Python lists (transformers 4.36-4.39, ``planner.moe_loop.list_index_host``) its further drained ops and the
    host's list conversions, which the device waits for (on the CPU profile they are its own time); 0.0 without
    the loop."""
    syncs = loop_syncs(model, config)
    if not syncs:
        return 0.0
    op_s = host_op_seconds(gpu, config)
    ops, lists_s = list_index_host(model, config, cpu=gpu.is_cpu)
    return ((syncs * SYNC_DRAIN_OPS + ops) * op_s + lists_s) * config.grad_accum


def _host_waits_s(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> float:
    """Host seconds per step the device waits for outside its micro-steps' kernels, the ``scheme_host`` of
    ``_step_parts``: the sharding scheme's units (``_scheme_host_s``) and the expert loop's drains (``_loop_drain_s``)."""
    return _scheme_host_s(model, config, gpu) + _loop_drain_s(model, config, gpu)


def _step_parts(config: TrainConfig, rates: _Rates, micro: tuple[float, ...], casts: float, trainable: int,
                update_bytes: float, params_total: int, quantized: int, host: tuple[float, float, float] = (0.0, 0.0, 0.0),
                scheme_host: float = 0.0, dispatch: float = 0.0,
                step_dispatch: tuple[float, bool] = _NO_STEP_DISPATCH) -> tuple[float, ...]:
    """Seconds of each of ``PARTS`` from what the configuration's terms depend on beyond itself
    (``step_breakdown`` computes those afresh, ``ThroughputMemo`` once per search); ``micro`` is
    one micro-step's (gemm, attention, recompute, elementwise, overhead) seconds, ``casts`` its AMP
    weight-cast bytes (``planner.kernels.weight_cast_bytes``); ``host`` the CPU profile's (fresh bytes per
    micro-step, fresh bytes per step, optimizer host seconds): ``fresh_bytes``, ``_optimizer_host_s``; ``scheme_host``
    the host seconds per step the device waits for beyond its micro-steps' kernels (the sharding scheme's,
    ``_scheme_host_s``; the expert loop's drains, ``_loop_drain_s``), in ``overhead``; ``dispatch`` a GPU's host
    seconds per micro-step (its ops x ``planner.kernels.host_op_seconds``): where it outlasts the micro-step's
    device time, the difference is in ``overhead`` (``planner.kernels.host_excess``); ``step_dispatch`` the optimizer
    step's host seconds on a GPU and whether they add to its device time or bound it (``_step_dispatch``)."""
    accum = config.grad_accum
    offloaded = config.sharding.offloaded
    device_bw = rates.kernels.bandwidth
    if offloaded:
        optimizer_s = trainable / config.gpus * update_bytes / rates.host_bw
    else:
        stepped = trainable / config.gpus if config.sharding.spec.partitions_optimizer else trainable
        optimizer_s = stepped * update_bytes / device_bw
    step_host, serial = step_dispatch
    if step_host:
        optimizer_s = optimizer_s + step_host if serial else max(optimizer_s, step_host)
    gemm_s, attention_s, recompute_s, elementwise_s, overhead_s = micro
    if casts:
        elementwise_s += casts / device_bw
    fresh_micro, fresh_step, optimizer_host = host
    if fresh_micro or fresh_step or optimizer_host:
        elementwise_s += fresh_micro * rates.first_touch
        optimizer_s += fresh_step * rates.first_touch + optimizer_host
    if dispatch:  # the device waits for the host where the micro-step's kernels are shorter than its dispatch
        overhead_s += host_excess(gemm_s + attention_s + recompute_s + elementwise_s + overhead_s, dispatch)
    # the dequantisation, collectives and offload copies are 0 bytes (then 0.0 s, as their functions
    # give) without QLoRA, on one GPU and without offload: not called then (the search times ~1,700 plans)
    return (
        gemm_s * accum,
        attention_s * accum,
        recompute_s * accum,
        elementwise_s * accum,
        (_dequant_bytes(config, quantized) if config.method is _QLORA else 0.0) / device_bw,
        optimizer_s,
        overhead_s * accum + scheme_host,
        (_comm_bytes(config, trainable, params_total, quantized) if config.gpus != 1 else 0.0) / rates.link_bw,
        (_offload_bytes(config, trainable, params_total) if offloaded else 0.0) / rates.host_link_bw,
    )


def _with_fp8(micro: tuple[float, ...], fp8: tuple[float, float, float, float]) -> tuple[float, ...]:
    """One micro-step's (gemm, attention, recompute, elementwise, overhead) seconds with fp8's own
    (``planner.kernels.fp8_seconds``: its GEMMs at the FP8 rate, its casts) added."""
    gemm_s, attention_s, recompute_s, elementwise_s, overhead_s = micro
    return (gemm_s + fp8[0], attention_s, recompute_s + fp8[1], elementwise_s + fp8[2], overhead_s + fp8[3])


def step_breakdown(*, model: ModelSpec, config: TrainConfig, gpu: GPUSpec, utilization: float | None = None,
                   paged_host: int = 0) -> dict[str, float]:
    """Seconds of one optimizer step by part (the search ranks on their sum; see
    ``estimate_throughput`` for the assumptions); ``paged_host``: the paged optimizer states the
    memory estimate leaves on the host (``MemoryEstimate.paged_host_bytes``)."""
    return _breakdown(model, config, gpu, utilization, paged_host, _dispatch_s(model, config, gpu))


def _breakdown(model: ModelSpec, config: TrainConfig, gpu: GPUSpec, utilization: float | None, paged_host: int,
               dispatch: float) -> dict[str, float]:
    """``step_breakdown`` with ``dispatch`` the host seconds per micro-step the kernels cannot go below (0.0: none)."""
    rates = _rates(gpu, config.precision, utilization)
    tokens = config.micro_batch * config.seq_len
    micro = price(micro_terms(model, config, gpu), rates.kernels).at(tokens)
    if config.precision is Precision.FP8:
        micro = _with_fp8(micro, fp8_seconds(fp8_work(model, config), rates.kernels, tokens))
    parts = _step_parts(
        config, rates=rates, casts=weight_cast_bytes(config, block_weights(model)),
        micro=micro,
        trainable=trainable_params(model, config), update_bytes=_update_bytes_per_param(config, gpu),
        params_total=model.params_total, quantized=_quantized_weights(model) if config.method is Method.QLORA else 0,
        host=_host_terms(model, config, gpu), scheme_host=_host_waits_s(model, config, gpu), dispatch=dispatch,
        # the host floors are off with ``dispatch`` (``calibration_terms``): the step's with the micro-steps'
        step_dispatch=_step_dispatch(model, config, gpu) if dispatch else _NO_STEP_DISPATCH,
    )
    return dict(zip(PARTS, _with_paging(parts, paged_host, rates)))


def _dispatch_s(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> float:
    """A GPU's host seconds per micro-step: its eager ops (fp8's casts and GEMMs among them) x
    ``planner.kernels.host_op_seconds``; 0.0 on the CPU profile."""
    ops = ops_per_micro_step(model, config)
    if config.precision is Precision.FP8:
        ops += fp8_work(model, config).ops
    return ops * host_op_seconds(gpu, config)


def _host_terms(model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> tuple[float, float, float]:
    if not gpu.is_cpu:
        return 0.0, 0.0, 0.0
    return (*fresh_bytes(model=model, config=config, gpu=gpu), _optimizer_host_s(model, config, gpu))


def calibration_terms(*, model: ModelSpec, config: TrainConfig, gpu: GPUSpec) -> tuple[float, float, float]:
    """The step as ``planner calibrate`` fits it, ``t = M / mfu + B / e + C``: M the seconds of
    every FLOP at the peak (GEMMs, attention, recompute), B the seconds of every device byte at the
    datasheet bandwidth (GEMM operands, elementwise work, dequantisation, the on-device optimizer
    update), C the rest (per-op overhead, collectives, offload copies, host-side Adam). The host's dispatch
    (``planner.kernels.host_op_seconds``) is left out: ``max(device, host)`` has no term in this sum, so a run the
    host bounds (a small model at a short micro-batch) is not one the fit can read rates from."""
    micro = micro_terms(model, config, gpu).at(config.micro_batch * config.seq_len)
    peak = gpu.peak_tflops(config.precision) * 1e12
    bandwidth = gpu.mem_bandwidth_gbs * 1e9
    parts = _breakdown(model, config, gpu, None, 0, 0.0)  # the device's side: the host floor is no linear term
    on_device = not config.sharding.offloaded  # else the optimizer is DeepSpeed's CPU Adam: host DRAM
    # the CPU's page faults and optimizer host time are in the optimizer part but at neither rate: C
    fresh_micro, fresh_step, optimizer_host = _host_terms(model, config, gpu)
    touch = CPU_FIRST_TOUCH_SECONDS_PER_BYTE if gpu.is_cpu else 0.0
    host_s = fresh_step * touch + optimizer_host
    device_bytes_s = parts["dequant"] + (parts["optimizer"] - host_s if on_device else 0.0)
    device_bytes_s *= bandwidth_efficiency(gpu)  # back to the datasheet bandwidth
    return (micro.flops * config.grad_accum / peak,
            (micro.bytes + weight_cast_bytes(config, block_weights(model))) * config.grad_accum / bandwidth
            + device_bytes_s,
            parts["overhead"] + parts["comm"] + parts["offload"] + (0.0 if on_device else parts["optimizer"])
            + (host_s + fresh_micro * touch * config.grad_accum if on_device else 0.0))


class ThroughputMemo:
    """``step_breakdown`` for many configurations of one model on one device, with what does not
    change between them computed once: the search ranks thousands of candidates that share their
    kernels' seconds per micro-step (per adapter set, checkpointing, micro-batch, sequence length,
    attention and precision), their trainable parameters and their rates and update traffic (per
    method, precision, optimizer and sharding).
    Each memo is keyed on exactly the fields its values read. Lives as long as the search that
    holds it (beside ``planner.search.MemoryMemo``), so it never outlives its model or device."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, utilization: float | None = None) -> None:
        self.model, self.gpu, self.utilization = model, gpu, utilization
        self._quantized: int | None = None
        self._weights = 0
        # (method, lora_r, lora_targets) -> trainable params
        self._trainable: dict[tuple, int] = {}
        # (method, lora_r, lora_targets, grad_ckpt, seq_len, attention, packing, adapters' dropout, activation
        #  bytes, AMP's weight casts, fp32 adapters) -> the micro-step's work at any micro-batch (``_micro_work``);
        #  (method, precision, lora_r, lora_targets, grad_ckpt, seq_len, attention, packing, adapters' dropout, AMP's
        #  weight casts) -> (its seconds on this device, trainable params, AMP's weight-cast bytes)
        self._work: dict[tuple, MicroTerms] = {}
        self._micro: dict[tuple, tuple[PricedTerms, int, float]] = {}
        # (method, precision, optimizer, sharding) -> (rates, update bytes per parameter, AMP casts);
        # the rates read the precision only
        self._device: dict[tuple, tuple[_Rates, float, bool]] = {}
        self._rates: dict[Precision, _Rates] = {}
        # (optimizer, method, lora_targets, precision, sharding) -> the optimizer step's host dispatch (``_step_dispatch``)
        self._dispatch: dict[tuple, tuple[float, bool]] = {}
        # fp8 (full fine-tuning only): grad_ckpt -> its converted linears' work (``planner.kernels.fp8_work``)
        self._fp8: dict[bool, object] = {}

    def breakdown(self, config: TrainConfig, paged_host: int = 0) -> dict[str, float]:
        """``step_breakdown(model=, config=, gpu=, utilization=, paged_host=)``, the same floats."""
        return dict(zip(PARTS, self._parts(config, paged_host)))

    def step_seconds(self, config: TrainConfig, paged_host: int = 0) -> float:
        """``sum(step_breakdown(...).values())``, the same float (summed in the same order)."""
        return sum(self._parts(config, paged_host))

    def _parts(self, config: TrainConfig, paged_host: int = 0) -> tuple[float, ...]:
        method, precision = config.method, config.precision
        device = self._device.get((method, precision, config.optimizer, config.sharding)) or self._device_terms(config)
        rates, update_bytes, casts = device
        # the fields the micro-step's priced work, the trainable parameters and AMP's weight-cast bytes read,
        # as they are (the work's own key, ``_micro_work``, derives a coarser one from them: working it out
        # per call cost more than the lookup); the dropout as whether the adapters drop their inputs, all
        # the work reads of it
        key = (method, precision, config.lora_r, config.lora_targets, config.grad_ckpt, config.seq_len,
               config.attention, config.packing, drops_adapter_inputs(config), casts, config.compile)
        found = self._micro.get(key)
        if found is None:
            found = self._micro[key] = self._micro_terms(config, rates, casts)
        terms, trainable, cast_bytes = found
        tokens = config.micro_batch * config.seq_len
        micro = terms.at(tokens)
        ops = terms.ops
        if precision is _FP8:
            work = self._fp8.get(config.grad_ckpt)
            if work is None:
                work = self._fp8[config.grad_ckpt] = fp8_work(self.model, config)
            micro = _with_fp8(micro, fp8_seconds(work, rates.kernels, tokens))
            ops += work.ops
        parts = _step_parts(config, rates, micro, cast_bytes, trainable, update_bytes, self.model.params_total,
                            self._quantized, _host_terms(self.model, config, self.gpu) if self.gpu.is_cpu else _NO_HOST,
                            _host_waits_s(self.model, config, self.gpu),
                            ops * host_op_seconds(self.gpu, config), self._step_dispatch(config))
        return _with_paging(parts, paged_host, rates) if paged_host else parts

    def knob_class(self, config: TrainConfig) -> tuple | None:
        """What ``step_seconds`` reads of ``config``'s optimizer and sharding: two configurations
        equal but for those whose classes are equal take equal step times at every split and
        paging. ``_parts`` reads them through the device terms (update bytes per parameter, AMP's
        weight casts, the rates by precision) and ``_step_parts``: on one GPU without offload,
        only whether the sharding partitions the optimizer; with collectives (more GPUs) or host
        copies (offload), the scheme's own byte counts, which read the configuration further, so
        there the class is the optimizer and sharding themselves. None on the CPU profile, whose
        host terms (``_host_terms``) read the optimizer's path and tensors. The search times
        about 1,700 fitting plans of about 500 distinct step times (Llama-2-7B on an A10G, every
        precision: ZeRO-1/2 without offload on one GPU step as the plain plan of their casts)."""
        if self.gpu.is_cpu:
            return None
        _, update_bytes, casts = (self._device.get((config.method, config.precision, config.optimizer, config.sharding))
                                  or self._device_terms(config))
        sharding = config.sharding
        if sharding.offloaded or config.gpus != 1:
            return update_bytes, casts, config.optimizer, sharding
        return update_bytes, casts, sharding.spec.partitions_optimizer, self._step_dispatch(config)

    def _step_dispatch(self, config: TrainConfig) -> tuple[float, bool]:
        """``_step_dispatch`` of ``config``, by what it reads (the optimizer, what is trained, the precision and
        whether the scheme steps the optimizer itself)."""
        key = (config.optimizer, config.method, config.lora_targets, config.precision, config.sharding)
        found = self._dispatch.get(key)
        if found is None:
            found = self._dispatch[key] = _step_dispatch(self.model, config, self.gpu)
        return found

    def _micro_terms(self, config: TrainConfig, rates: _Rates, casts: bool) -> tuple[PricedTerms, int, float]:
        """(the micro-step's seconds at any micro-batch, trainable parameters, AMP's weight-cast bytes) of ``config``."""
        trainable = self._trainable.get((config.method, config.lora_r, config.lora_targets))
        if trainable is None:
            trainable = self._trainable[config.method, config.lora_r, config.lora_targets] = \
                trainable_params(self.model, config)
        cast_bytes = weight_cast_bytes(config, self._weights) if casts else 0.0
        return price(self._micro_work(config, casts), rates.kernels), trainable, cast_bytes

    def _device_terms(self, config: TrainConfig) -> tuple[_Rates, float, bool]:
        """(rates, update bytes per parameter, AMP casts) of ``config``'s method, precision, optimizer and sharding."""
        rates = self._rates.get(config.precision)
        if rates is None:
            rates = self._rates[config.precision] = _rates(self.gpu, config.precision, self.utilization)
        if self._quantized is None:
            self._quantized = _quantized_weights(self.model)
            self._weights = block_weights(self.model)
        key = (config.method, config.precision, config.optimizer, config.sharding)
        found = self._device[key] = (rates, _update_bytes_per_param(config, self.gpu), casts_weights(config))
        return found

    def _micro_work(self, config: TrainConfig, casts: bool) -> MicroTerms:
        """The micro-step's work at any micro-batch, by what ``micro_terms`` reads (fp32 is the 4-byte precision;
        AMP's fp32 weights make the residual stream fp32: ``planner.kernels.fp32_stream``)."""
        shape = (config.method, config.lora_r, config.lora_targets, config.grad_ckpt, config.seq_len, config.attention,
                 config.packing, drops_adapter_inputs(config), config.precision.compute_bytes, casts,
                 fp32_adapters(config), config.compile)
        work = self._work.get(shape)
        if work is None:
            work = self._work[shape] = micro_terms(self.model, config, self.gpu)
        return work


def tokens_per_second(config: TrainConfig, step_s: float) -> float:
    """Tokens per second across all devices for a step of ``step_s`` seconds."""
    return config.global_batch * config.seq_len / step_s


def _mfu_source(gpu: GPUSpec, precision: Precision, *, given: bool) -> str:
    if given:
        return "given"
    if matmul_dtype(precision) in gpu.mfu:
        return "calibrated"
    return "default: the published achieved GEMM rate; planner calibrate fits it from measurements"


#: What a compiled plan rests on (``TrainConfig.compile``), the memory's bound among it: the min-cut partitioner saves
#: fewer tensors than eager autograd (torch/_functorch/partitioners.py: pointwise ops recomputed in backward), which
#: no memory term models (bench/compile_cpu.py saved: a 2-block LlamaForCausalLM saves 0.77x eager's bytes for
#: backward compiled in fp32, 0.71x under bf16 autocast).
_COMPILE_ASSUMPTION = (
    "torch.compile (Inductor, mode default, no CUDA graphs): the elementwise work between GEMMs and attention as fused "
    "kernels, each reading its inputs and writing its outputs once, one launch and one host call per kernel "
    "(planner.kernels.compiled_elementwise_bytes, compiled_kernels_per_micro_step); GEMMs and attention as eager's; "
    "the first steps' compilation not counted. Memory is eager's saved tensors, an upper bound: AOTAutograd's "
    "min-cut partitioner recomputes pointwise ops in backward instead of saving them, so a compiled run keeps less "
    "(a small Llama's saved tensors: 0.71-0.77x)")


def _attention_assumption(config: TrainConfig, model: ModelSpec, gpu: GPUSpec) -> str:
    if cpu_sdpa_math(model, config, gpu):
        return (f"sdpa attention on the CPU with attention dropout: its fp32 math path (the whole T x T product, "
                f"scores and mask materialised) at {CPU_MATH_FRACTION_OF_GEMM:.0%} of the GEMM rate (measured)")
    if gpu.is_cpu and config.attention is Attention.SDPA and config.precision is not Precision.FP32:
        return f"sdpa attention on the CPU: its flash kernel, causal, at {CPU_FLASH_FRACTION_OF_GEMM:.0%} of the GEMM rate (measured)"
    if config.attention is Attention.EAGER or config.precision is Precision.FP32 and config.attention is Attention.SDPA:
        return "eager attention: the full T x T product at the GEMM rate, its scores materialised at memory speed"
    if config.packing:
        return f"{config.attention} attention: causal, the fused kernel skips the masked half"
    return f"{config.attention} attention with a padding mask: the full T x T product"


def estimate_throughput(
    *, model: ModelSpec, config: TrainConfig, gpu: GPUSpec, utilization: float | None = None,
    paged_host: int = 0,
) -> ThroughputEstimate:
    """Predict the time of one optimizer step and the tokens per second across all devices
    (``paged_host``: the paged optimizer states the memory estimate leaves on the host)."""
    check_precision(gpu, config.precision)
    utilization_given = utilization is not None
    utilization = _utilization(gpu, config.precision, utilization)
    breakdown = step_breakdown(model=model, config=config, gpu=gpu, utilization=utilization,
                               paged_host=paged_host)
    step_s = sum(breakdown.values())
    assert step_s > 0, breakdown
    offloaded = config.sharding.offloaded

    assumptions = [
        f"large GEMMs at {utilization:.0%} of {gpu.display_name}'s {gpu.peak_tflops(config.precision):g} "
        f"TFLOP/s {config.precision} peak (MFU {_mfu_source(gpu, config.precision, given=utilization_given)}); "
        "each GEMM on the roofline of its shape (skinny ones at memory speed)",
        "parts add up with no overlap of compute, communication and copies (conservative)",
        _attention_assumption(config, model, gpu),
    ]
    if config.precision is Precision.FP8:
        assumptions.append(f"fp8: torchao's float8 linears (accelerate's torchao backend, eager) at {gpu.fp8_tflops:g} "
                           f"TFLOP/s FP8 peak x {utilization:.0%}; each cast of an operand to fp8 at memory speed")
    dispatch = _dispatch_s(model, config, gpu)
    units = _scheme_host_s(model, config, gpu)  # FSDP1's adapter units (ShardingSpec.host_seconds)
    drain = _loop_drain_s(model, config, gpu)  # transformers 4's expert loop's syncs
    micro_s = sum(breakdown[k] for k in _MICRO_PARTS) - units - drain  # per step, all micro-steps
    if dispatch and micro_s <= dispatch * config.grad_accum * (1 + 1e-9):
        assumptions.append(f"host-bound: each micro-step's eager ops take {dispatch:.3g} s of host dispatch "
                           f"({host_op_seconds(gpu, config) * 1e6:.1f} us each: Python, dispatcher, autograd, autocast and "
                           "the CUDA launch), longer than their kernels, which wait for it")
    if breakdown["overhead"]:
        assumptions.append(f"{breakdown['overhead']:.3g} s of host time per step the device waits for "
                           + ("(kernels" if config.compile else "(eager ops") + " too small to hide their launch"
                           + (f"; {units:.3g} s of it {config.sharding.scheme}'s per-unit hooks" if units else "")
                           + (f"; {drain:.3g} s of it after the expert loop's host-device syncs"
                              + (" and in its Python-list indexing" if config.experts_list_index else "") if drain else "")
                           + ")")
    if gpu.is_cpu:
        fresh_micro, fresh_step = fresh_bytes(model=model, config=config, gpu=gpu)
        if fresh_micro or fresh_step:
            touched = (fresh_micro * config.grad_accum + fresh_step) * CPU_FIRST_TOUCH_SECONDS_PER_BYTE
            assumptions.append(f"{touched:.3g} s of page faults: tensors of {MMAP_THRESHOLD_BYTES // 2**20} MiB or more "
                               "are mapped afresh each step "
                               "(glibc mmap; c10's CPU allocator keeps nothing)")
        if _cpu_adamw(gpu, config):
            assumptions.append(f"torch.optim.AdamW's {gpu.kernels.adamw} path: {ADAMW_SINGLE_TENSOR_PASSES} element "
                               "passes and its host time per parameter tensor")
    if config.compile:
        assumptions.append(_COMPILE_ASSUMPTION)
    assumptions.append(f"elementwise and memory-bound kernels at {bandwidth_efficiency(gpu):.0%} of {gpu.mem_bandwidth_gbs:g} GB/s"
                       + (" (calibrated)" if gpu.bandwidth_efficiency is not None else ""))
    if config.gpus > 1:
        assumptions.append(
            f"collectives over {gpu.interconnect} at {link_gbs(gpu):g} GB/s per direction, ring algorithm"
            + (f" ({NVLINK_PAYLOAD_FRACTION:.0%} of its {gpu.interconnect_gbs:g} GB/s line rate: NVLink's packet overhead)"
               if link_gbs(gpu) != gpu.interconnect_gbs else "")
        )
    if offloaded:
        assumptions.append(
            f"CPU Adam at {HOST_DRAM_GBS_PER_RANK if not gpu.is_cpu else gpu.mem_bandwidth_gbs:g} GB/s of host "
            f"DRAM per rank; copies over {gpu.host_link_gbs:g} GB/s host link"
        )
    if paged_host:
        unpaged = step_breakdown(model=model, config=config, gpu=gpu, utilization=utilization)
        assumptions.append(f"paged optimizer states: {paged_host / 2**30:.2f} GiB on the host migrated in and out "
                           f"each step over the {gpu.host_link_gbs:g} GB/s host link "
                           f"({breakdown['offload'] - unpaged['offload']:.3g} s)")
    if gpu.calibration:
        assumptions.append(gpu.calibration)
    tokens_per_device = config.micro_batch * config.seq_len * config.grad_accum
    return ThroughputEstimate(
        step_s=step_s,
        tokens_per_s=tokens_per_second(config, step_s),
        flops_per_step=flops_per_token(model=model, config=config).model * tokens_per_device,
        breakdown_s=breakdown,
        assumptions=tuple(assumptions),
    )


__all__ = [
    "PARTS",
    "FlopsPerToken",
    "ThroughputMemo",
    "bandwidth_efficiency",
    "calibration_terms",
    "comm_bytes_per_step",
    "default_utilization",
    "estimate_throughput",
    "flops_per_token",
    "fresh_bytes",
    "link_gbs",
    "offload_bytes_per_step",
    "optimizer_bytes_per_param",
    "paging_bytes_per_step",
    "step_breakdown",
    "tokens_per_second",
]
