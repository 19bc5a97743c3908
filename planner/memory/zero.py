"""DeepSpeed ZeRO: what each rank keeps of the model states, its buckets, and its offload.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1): 16-bit params and
gradients, an fp32 master copy of the trainable partition and the optimizer states of that
partition. DeepSpeed flattens the trainable parameters into one fp32 master partition per device
and runs the optimizer (its own or the client's) on that flat tensor
(deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups).
"""

from __future__ import annotations

import functools
import math

from planner.config import Method, Offload, TrainConfig
from planner.memory.dtypes import FP32, HALF
from planner.memory.parameters import Trained, param_tensor_sizes
from planner.modelspec import ModelSpec
from planner.optim import OPTIMIZERS

#: DeepSpeed's defaults for the two ZeRO-3 bounds our configs leave unset (deepspeed 0.19.8
#: runtime/zero/config.py l.245 max_live_parameters, l.251 max_reuse_distance: pp_int(1e9))
DS_MAX_LIVE_PARAMETERS = 10**9
DS_MAX_REUSE_DISTANCE = 10**9
#: the base model's tensors whatever the method (``param_tensor_sizes`` reads only the method)
_FULL = TrainConfig(method=Method.FULL)


def deepspeed_buckets(hidden_size: int) -> dict[str, int]:
    """The communication buffer sizes (elements) our DeepSpeed configs set and this model assumes.

    DeepSpeed's own defaults are 5e8 elements for reduce_bucket_size and allgather_bucket_size
    (deepspeed/runtime/zero/config.py), about 1 GB of 16-bit buffers whatever the model; the HF
    Trainer's "auto" values scale with the model instead (transformers integrations/deepspeed.py
    HfTrainerDeepSpeedConfig): reduce bucket hidden², ZeRO-3 prefetch 0.9·hidden², parameter
    persistence threshold 10·hidden. ``workers.deepspeed_config`` writes these; the model counts
    the reduce bucket (``zero/reduce_bucket``) and, for ZeRO-3, the gathered parameters
    (``zero3_live_params``). Neither our configs nor the HF Trainer set stage3_max_live_parameters
    or stage3_max_reuse_distance, so DeepSpeed's 1e9 defaults apply; they are listed here as the
    values the model uses.
    """
    return {
        "reduce_bucket_size": reduce_bucket_size(hidden_size),
        "allgather_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": persistence_threshold(hidden_size),
        "stage3_max_live_parameters": DS_MAX_LIVE_PARAMETERS,
        "stage3_max_reuse_distance": DS_MAX_REUSE_DISTANCE,
    }


def reduce_bucket_size(hidden_size: int) -> int:
    """``deepspeed_buckets``' reduce bucket (elements), which the model counts: the terms read it
    alone, without building the whole dict."""
    return hidden_size * hidden_size


def persistence_threshold(hidden_size: int) -> int:
    """``deepspeed_buckets``' stage3_param_persistence_threshold (elements), read alone too."""
    return 10 * hidden_size


def zero3_live_params(sizes: tuple[int, ...], *, max_live: int, max_reuse: int, persistence_threshold: int) -> int:
    """Most elements of partitioned parameters ZeRO-3 holds gathered at once, from the element
    counts ``sizes`` of every parameter tensor (frozen ones too).

    DeepSpeed's coordinator (deepspeed 0.19.8 runtime/zero/partitioned_param_coordinator.py)
    fetches a module's parameters when the module runs, whatever their number (l.366-376), and
    after each fetch, with a complete trace, prefetches the next parameters of the trace while
    ``numel_prefetching < min(max_live - n_available, prefetch_bucket)`` (l.452-478): the loop
    adds a whole parameter past the bound, and it runs at every module's pre-forward and
    pre-backward hook, parameter-less ones included, so the look-ahead grows up to max_live
    whatever the bucket. A module's parameters are not released while they are used again within
    max_reuse_distance elements of the trace (l.653-662), however many are gathered: the kept
    ones are the parameters of the next max_reuse_distance elements. Persistent parameters
    (``numel <= stage3_param_persistence_threshold``, partition_parameters.py l.1292) never
    leave. Hence at most max(max_live, max_reuse_distance) elements plus one parameter past the
    bound, the largest at worst (with a tied embedding, the output head's weight, prefetched while
    the last blocks still hold up to max_live), and never more than the partitioned parameters
    themselves. Measured on the CPU (tests/test_zero3_live.py; a 30-block bloom scaled from
    bloom-7b1, max_live = max_reuse = 3,921,700, tied embedding 4,032,000: 7,767,552 elements at
    most, 2.4 % under this bound)."""
    partitioned = [s for s in sizes if s > persistence_threshold]
    return min(sum(partitioned), max(max_live, max_reuse) + max(partitioned, default=0))


@functools.lru_cache(maxsize=256)
def zero3_param_split(model: ModelSpec, adapter_sizes: tuple[int, ...], persistence_threshold: int) -> tuple[int, int, int]:
    """(partitioned elements, persistent elements, elements gathered at most) of a ZeRO-3 model:
    the base model's tensors and the adapters' (``adapter_sizes``). ZeRO-3 partitions every
    parameter, trainable or frozen (zero.Init converts the whole module: partition_parameters.py
    l.1286-1297 decides persistence by size alone, ``_partition_param`` l.1778 on every
    parameter), except the persistent ones, which stay whole on every rank and on the device
    even with parameter offload (l.1829-1830)."""
    sizes = param_tensor_sizes(model, _FULL) + adapter_sizes
    persistent = sum(s for s in sizes if s <= persistence_threshold)
    live = zero3_live_params(sizes, max_live=DS_MAX_LIVE_PARAMETERS, max_reuse=DS_MAX_REUSE_DISTANCE,
                             persistence_threshold=persistence_threshold)
    return sum(sizes) - persistent, persistent, live


def zero3_gathered_bytes(model: ModelSpec, config: TrainConfig, t: Trained) -> int:
    """Device bytes of ZeRO-3's gathered parameters at most (forward and backward).

    A gather allocates only when the parameter is not already whole on the device: on one rank
    without parameter offload DeepSpeed hands the partition itself to the module (all_gather_
    coalesced, partition_parameters.py l.1563: world size 1 -> ``_no_gather_coalesced``;
    NoGatherHandle l.74: ``param.ds_tensor.data.to(device)``, the same tensor), so it costs
    nothing; with parameter offload that ``.to`` copies from the host, and on N ranks the
    all-gather fills a new buffer of ceil(numel / N) * N elements (l.1388) in the 16-bit (or
    fp32) communication dtype."""
    if config.gpus == 1 and config.offload is not Offload.OPTIMIZER_PARAMS:
        return 0
    adapters = t.sizes if config.method.uses_adapters else ()
    threshold = persistence_threshold(model.hidden_size)
    _, _, live = zero3_param_split(model, adapters, threshold)
    return live * comm_bytes(config)


def zero_partition(t: Trained, config: TrainConfig) -> int:
    """Trainable elements in this rank's DeepSpeed partition: one flat tensor of T/N."""
    return math.ceil(t.count / config.gpus)


def comm_bytes(config: TrainConfig) -> int:
    """Bytes per element of DeepSpeed's device-side params, gradients and buckets: 16-bit in
    mixed precision (DeepSpeed casts the model), else fp32."""
    return HALF if config.precision.is_mixed else FP32


def zero_states(model: ModelSpec, config: TrainConfig, t: Trained, *, weights: int | None, param_bytes: int,
                grads: int) -> tuple[dict[str, int], int]:
    """(device bytes by component, host bytes) of the ZeRO stage's model states. ``weights``: the
    device bytes of the unquantised weights without DeepSpeed (None for 4-bit ones); ``grads``:
    the unpartitioned gradient bytes in the trainable dtype ``param_bytes``. No "weights" key in
    the answer means the weights live on the host."""
    n, gb, full = config.gpus, comm_bytes(config), config.method is Method.FULL
    trainable = t.count
    partition = zero_partition(t, config)
    # the optimizer steps one flat fp32 partition: no per-tensor 8-bit threshold, no Adafactor
    # factoring of a 1-D tensor
    states_per_device = OPTIMIZERS[config.optimizer].memory.flat_partition_state_bytes(partition)
    out: dict[str, int] = {} if weights is None else {"weights": weights}
    host = 0
    if full:
        # DeepSpeed casts the model to its communication dtype
        out["weights"] = model.params_total * gb
    if config.zero == 3:
        host += _zero3_weights(model, config, t, out)
        out["zero3/gathered_params"] = zero3_gathered_bytes(model, config, t)
        # ZeRO-3 allocates the flat 16-bit gradient partition when it is built, so it is alive
        # through the whole step (stage3.py _setup_for_real_optimizer grad_partitions_flat_buffer);
        # with optimizer offload it is built on the host and pinned (deepspeed 0.19.8 stage3.py
        # l.333: self.device = cpu when offload_optimizer; l.791-795: torch.zeros(..., device=
        # self.device), then pin_memory), and partition_grads copies each reduced gradient there
        # (l.2022-2045)
        grad_partitions = grads * gb // param_bytes // n
        if config.offload is Offload.NONE:
            out["zero3/grad_partitions"] = grad_partitions
        else:
            host += grad_partitions
    else:
        out["gradients"] = grads * gb // param_bytes if config.zero == 1 else grads * gb // param_bytes // n
    out["zero/reduce_bucket"] = reduce_bucket_size(model.hidden_size) * gb
    if config.offload is Offload.NONE:
        out["master_weights"] = FP32 * trainable // n
        out["optimizer_states"] = states_per_device
        return out, host
    return out, host + _offload_host(config, t, out, states_per_device)


def _zero3_weights(model: ModelSpec, config: TrainConfig, t: Trained, out: dict[str, int]) -> int:
    """Splits ``out["weights"]`` (the whole model's weights, frozen LoRA base weights included)
    into what ZeRO-3 keeps on this device and returns the host bytes: every rank holds 1/N of
    the partitioned parameters (on the host with parameter offload) and the persistent ones whole
    (``zero3_param_split``)."""
    if "weights" not in out:
        return 0
    per_element = out["weights"] / model.params_total
    base_persistent = zero3_param_split(
        model, (), persistence_threshold(model.hidden_size))[1]
    partition = int((model.params_total - base_persistent) * per_element) // config.gpus
    persistent = int(base_persistent * per_element)
    if config.offload is Offload.OPTIMIZER_PARAMS:
        out["weights"] = persistent
        return partition
    out["weights"] = partition + persistent
    return 0


def _offload_host(config: TrainConfig, t: Trained, out: dict[str, int], states_per_device: int) -> int:
    """Host bytes of ZeRO-Offload for one rank (every rank of the node holds as much): the fp32
    master partition, DeepSpeedCPUAdam's moments and the fp32 gradient partition it steps from
    (ZeRO-Offload, Ren et al. 2021, §4.1; pinned: stage3.py l.1338-1342 subgroup_gradient_buffer,
    stage_1_and_2.py l.940-941); stage 1/2 add the pinned 16-bit copy of the partition it writes
    back from (stage_1_and_2.py l.566-573 param_buffer_of_bit16_for_cpu_offload_groups) and a
    pinned host gradient buffer of the largest parameter (l.654-658 temp_grad_buffer_for_cpu_offload).
    Adds to ``out`` the device-side staging buffer gradients go through to the host, one parameter
    at a time (temp_grad_buffer_for_gpu_offload). Line numbers: deepspeed 0.19.8.

    Not counted: with gradient accumulation, stage 1/2 also keep a pinned 16-bit host buffer per
    parameter of the partition (l.1823-1826 accumulated_grads_in_cpu, about 2 bytes per trainable
    element / N), created on the first micro-step that is not an accumulation boundary
    (l.2166-2167); the static terms the search memoises do not depend on the accumulation."""
    n, gb = config.gpus, comm_bytes(config)
    trainable = t.count
    host = FP32 * trainable // n + states_per_device + FP32 * trainable // n
    if config.zero in (1, 2):
        largest = max((n for n, _ in t.size_counts), default=0)
        host += gb * zero_partition(t, config) + gb * largest
        out["zero/offload_grad_buffer"] = gb * largest
    return host


def optimizer_phase_gradients(t: Trained, config: TrainConfig, device_grads: int) -> int:
    """Gradient bytes alive on the device while optimizer.step() runs.

    Without ZeRO: the gradients themselves. With ZeRO and no offload, DeepSpeed flattens this
    rank's gradients into one fp32 partition (stage 1/2: ``single_grad_partition``; stage 3: the
    fp32 partition's ``.grad``) and frees the 16-bit ones before stepping
    (stage_1_and_2.py step: free_grad_in_param_list). With offload the step runs on the host.
    """
    if config.zero == 0:
        return device_grads
    if config.offload is not Offload.NONE:
        return 0
    return FP32 * zero_partition(t, config)


def gradient_flatten(t: Trained, config: TrainConfig) -> int:
    """ZeRO-1/2 without offload, as the step begins: the 16-bit gradients of this rank's partition
    flattened into one tensor and that tensor's fp32 copy, both alive with the 16-bit gradients
    (stage_1_and_2.py step: flatten_dense_tensors_aligned(...).to(fp32); measured on gpt2 with an
    8-bit optimizer, whose own step adds nothing the probe sees). In fp32 the flat copy already
    is the fp32 partition (.to() returns it)."""
    if config.zero not in (1, 2) or config.offload is not Offload.NONE:
        return 0
    partition = zero_partition(t, config)
    return partition * HALF + FP32 * partition if config.precision.is_mixed else FP32 * partition


__all__ = ["DS_MAX_LIVE_PARAMETERS", "DS_MAX_REUSE_DISTANCE", "comm_bytes", "deepspeed_buckets", "gradient_flatten",
           "persistence_threshold", "reduce_bucket_size",
           "optimizer_phase_gradients", "zero3_gathered_bytes", "zero3_live_params", "zero3_param_split",
           "zero_partition", "zero_states"]
