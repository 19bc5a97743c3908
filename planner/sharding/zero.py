"""DeepSpeed ZeRO stages 1, 2 and 3: what each rank keeps of the model states, its buckets, its
offload, its traffic, its ``ds_config`` and what it refuses.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1): 16-bit params and
gradients, an fp32 master copy of the trainable partition and the optimizer states of that
partition. DeepSpeed flattens the trainable parameters into one fp32 master partition per device
and runs the optimizer (its own or the client's) on that flat tensor
(deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable

from planner.errors import InvalidConfigError, PlannerError, UnsupportedError
from planner.modelspec import LinearKind
from planner.optim import OPTIMIZERS, Optimizer, names
from planner.optim.spec import FP32, HALF
from planner.sharding.spec import BreakdownKey, Offload, ShardingSpec, WorkerSetup, join_process_group, ring
from planner.units import format_bytes

#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search's static terms read them thousands
#: of times a search
_NONE, _OPTIMIZER, _OPTIMIZER_PARAMS = Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS

#: The file name of the DeepSpeed config a run reads (``ZeRO.emitted_files``).
DEEPSPEED_FILE = "ds_config.json"

#: DeepSpeed's defaults for the two ZeRO-3 bounds our configs leave unset (deepspeed 0.19.8
#: runtime/zero/config.py l.245 max_live_parameters, l.251 max_reuse_distance: pp_int(1e9))
DS_MAX_LIVE_PARAMETERS = 10**9
DS_MAX_REUSE_DISTANCE = 10**9

#: What DeepSpeed takes of each optimizer (``planner.optim``): the ones it offloads, and each paged
#: one's unpaged twin (ZeRO's partitions are not paged).
_OFFLOADABLE = tuple(o for o in Optimizer if OPTIMIZERS[o].deepspeed_offload)
_UNPAGED = {o: OPTIMIZERS[o].unpaged for o in Optimizer if OPTIMIZERS[o].paged}


#: DeepSpeed's own value of each bucket key, what a ds_config that leaves the key out gets
#: (deepspeed 0.19.8 runtime/zero/config.py l.113 reduce_bucket_size pp_int(5e8), l.132
#: allgather_bucket_size pp_int(5e8), l.222 stage3_prefetch_bucket_size pp_int(5e7), l.228
#: stage3_param_persistence_threshold pp_int(1e5), l.245 stage3_max_live_parameters and l.251
#: stage3_max_reuse_distance pp_int(1e9)). The reduce bucket is the one that costs memory whatever
#: the model: stage3.py l.780-784 allocates torch.empty(reduce_bucket_size) per gradient dtype at
#: init, 953.7 MiB in fp16 at 5e8 elements.
DS_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 5 * 10**8,
    "allgather_bucket_size": 5 * 10**8,
    "stage3_prefetch_bucket_size": 5 * 10**7,
    "stage3_param_persistence_threshold": 10**5,
    "stage3_max_live_parameters": DS_MAX_LIVE_PARAMETERS,
    "stage3_max_reuse_distance": DS_MAX_REUSE_DISTANCE,
}


def zero_buckets(sharding: Any, hidden_size: int) -> dict[str, int]:
    """The bucket sizes (elements) a run of ``sharding`` uses: the planner's own file's
    (``deepspeed_buckets``) when ``sharding.buffers`` is None, else the user's file's keys over
    DeepSpeed's defaults (``DS_DEFAULTS``: a key left out gets DeepSpeed's value, not the HF
    Trainer's), "auto" where the Trainer fills it with its own value (transformers 5.24
    integrations/deepspeed.py l.204-240: reduce_bucket_size, stage3_prefetch_bucket_size,
    stage3_param_persistence_threshold; other "auto" keys keep DeepSpeed's default)."""
    ours = deepspeed_buckets(hidden_size)
    buffers = sharding.buffers
    if buffers is None:
        return ours
    out = dict(DS_DEFAULTS)
    for key, value in buffers:
        if key in out:
            out[key] = (ours[key] if key in _HF_AUTO else out[key]) if value == "auto" else value
    return out


#: the bucket keys the memory terms read (``_bucket``); the others size nothing the model counts
_READ = ("reduce_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
         "stage3_max_reuse_distance")


def users_buffers(sharding: Any, hidden_size: int) -> Any:
    """``sharding`` as ``planner check`` plans it: with its ``buffers`` where they change a memory
    term, else the planner's own (``buffers`` None: a file the planner wrote reads back as the
    same plan). FusedAdam (``torch_adam`` 0) changes the step's temporaries (``fused_step``)."""
    if sharding.buffers is None:
        return sharding
    theirs, ours = zero_buckets(sharding, hidden_size), deepspeed_buckets(hidden_size)
    read = _READ if sharding.spec.zero_stage == 3 else _READ[:1]  # ZeRO-1/2 read the reduce bucket alone
    if all(theirs[k] == ours[k] for k in read) and dict(sharding.buffers).get("torch_adam") != 0:
        return type(sharding)(sharding.scheme, sharding.offload)
    return sharding


def users_sharding(zero: int, offload: Any, buffers: dict[str, Any], hidden_size: int) -> Any:
    """The sharding of a run that reads the user's own DeepSpeed JSON: the stage and offload it
    names, with its ``buffers`` where they change a memory term (``users_buffers``)."""
    from planner.sharding import Sharding, from_zero

    named = from_zero(zero, offload)
    return users_buffers(Sharding(named.scheme, named.offload, buffers), hidden_size)


def auto_bucket_keys(zero_stage: int) -> tuple[str, ...]:
    """The bucket keys of ``zero_optimization`` a stage reads that the HF Trainer fills when a
    file says "auto" (``_HF_AUTO``): what a DeepSpeed JSON the planner changes or writes sets, so
    that the run holds the buckets the plan counts."""
    return ("reduce_bucket_size",) + (("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
                                      if zero_stage == 3 else ())


#: the bucket keys the HF Trainer fills when a ds_config says "auto" (``zero_buckets``)
_HF_AUTO = frozenset({"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"})


def deepspeed_buckets(hidden_size: int) -> dict[str, int]:
    """The communication buffer sizes (elements) our DeepSpeed configs set and this model assumes.

    DeepSpeed's own defaults are 5e8 elements for reduce_bucket_size and allgather_bucket_size
    (deepspeed/runtime/zero/config.py), about 1 GB of 16-bit buffers whatever the model; the HF
    Trainer's "auto" values scale with the model instead (transformers integrations/deepspeed.py
    HfTrainerDeepSpeedConfig): reduce bucket hidden², ZeRO-3 prefetch 0.9·hidden², parameter
    persistence threshold 10·hidden. ``ZeRO.emitted_files`` writes these; the model counts
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


def _bucket(model: Any, config: Any, key: str) -> int:
    """One bucket key of ``config``'s run (``zero_buckets``), the planner's file's read alone."""
    if config.sharding.buffers is None:
        return reduce_bucket_size(model.hidden_size) if key == "reduce_bucket_size" else \
            persistence_threshold(model.hidden_size) if key == "stage3_param_persistence_threshold" else DS_DEFAULTS[key]
    return zero_buckets(config.sharding, model.hidden_size)[key]


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
    themselves. Measured on the CPU (tests/sharding/test_zero3_live.py; a 30-block bloom scaled from
    bloom-7b1, max_live = max_reuse = 3,921,700, tied embedding 4,032,000: 7,767,552 elements at
    most, 2.4 % under this bound)."""
    partitioned = [s for s in sizes if s > persistence_threshold]
    return min(sum(partitioned), max(max_live, max_reuse) + max(partitioned, default=0))


@functools.lru_cache(maxsize=256)
def zero3_param_split(base_sizes: tuple[int, ...], adapter_sizes: tuple[int, ...],
                      persistence_threshold: int, max_live: int = DS_MAX_LIVE_PARAMETERS,
                      max_reuse: int = DS_MAX_REUSE_DISTANCE) -> tuple[int, int, int]:
    """(partitioned elements, persistent elements, elements gathered at most) of a ZeRO-3 model:
    the base model's tensors (``base_sizes``) and the adapters' (``adapter_sizes``). ZeRO-3
    partitions every parameter, trainable or frozen (zero.Init converts the whole module:
    partition_parameters.py l.1286-1297 decides persistence by size alone, ``_partition_param``
    l.1778 on every parameter), except the persistent ones, which stay whole on every rank and on
    the device even with parameter offload (l.1829-1830)."""
    sizes = base_sizes + adapter_sizes
    persistent = sum(s for s in sizes if s <= persistence_threshold)
    live = zero3_live_params(sizes, max_live=max_live, max_reuse=max_reuse, persistence_threshold=persistence_threshold)
    return sum(sizes) - persistent, persistent, live


def zero3_gathered_bytes(model: Any, config: Any, t: Any, base_sizes: tuple[int, ...]) -> int:
    """Device bytes of ZeRO-3's gathered parameters at most (forward and backward).

    A gather allocates only when the parameter is not already whole on the device: on one rank
    without parameter offload DeepSpeed hands the partition itself to the module (all_gather_
    coalesced, partition_parameters.py l.1563: world size 1 -> ``_no_gather_coalesced``;
    NoGatherHandle l.74: ``param.ds_tensor.data.to(device)``, the same tensor), so it costs
    nothing; with parameter offload that ``.to`` copies from the host, and on N ranks the
    all-gather fills a new buffer of ceil(numel / N) * N elements (l.1388) in the 16-bit (or
    fp32) communication dtype."""
    if config.gpus == 1 and config.sharding.offload is not _OPTIMIZER_PARAMS:
        return 0
    adapters = t.sizes if config.method.uses_adapters else ()
    threshold = _bucket(model, config, "stage3_param_persistence_threshold")
    _, _, live = zero3_param_split(base_sizes, adapters, threshold, _bucket(model, config, "stage3_max_live_parameters"),
                                   _bucket(model, config, "stage3_max_reuse_distance"))
    return live * comm_bytes(config)


def _zero3_released_after_forward(model: Any, config: Any, base_sizes: tuple[int, ...]) -> int:
    """Bytes of the gathered parameters ZeRO-3 releases after their forward because their module
    runs no backward, so they are not used again within max_reuse_distance: with LoRA, the frozen
    input embedding (untied; its output needs no gradient) and the first block's frozen q/k/v
    weights (they read the normed embeddings, which need none either; their adapters' weights
    train and run backward). Measured on 2 CPU ranks (llama-8k, LoRA all-linear): at the loss'
    backward every gathered parameter but these is live (7,013,376 B of 11,371,520). Only where
    every partitioned parameter is gathered at once (``zero3_live_params`` below its bound)."""
    if not config.method.uses_adapters or model.tied_embeddings:
        return 0
    threshold = _bucket(model, config, "stage3_param_persistence_threshold")
    partitioned = sum(s for s in base_sizes if s > threshold)
    if _bucket(model, config, "stage3_max_live_parameters") < partitioned:
        return 0
    sizes = [model.embedding_params] + [lin.in_features * lin.out_features for lin in model.layer_linears
                                        for _ in range(lin.count) if lin.kind is LinearKind.ATTN_IN]
    return sum(s for s in sizes if s > threshold) * comm_bytes(config)


def _adapter_weights(model: Any, config: Any, t: Any) -> int:
    """Device bytes of LoRA's adapters under DeepSpeed's 16-bit mode: cast to 16 bits with the
    rest of the model (runtime/engine.py _cast_module_mixed_precision; the fp32 copy of what trains
    is the optimizer's master partition), whole on every rank under ZeRO-1/2, partitioned like
    every parameter under ZeRO-3 but the persistent ones (zero.Init converts the whole module,
    partition_parameters.py l.1286-1297: persistence by size alone). Measured on 2 CPU ranks
    (llama-8k, LoRA all-linear r16): ZeRO-3 keeps 1/2 of each adapter of more than 10 x hidden
    elements and the k/v lora_B (128 x 16) whole, all in bf16."""
    gb = comm_bytes(config)
    if config.sharding.spec.zero_stage != 3:
        return t.count * gb
    threshold = _bucket(model, config, "stage3_param_persistence_threshold")
    n = config.gpus
    return sum((math.ceil(s / n) if s > threshold else s) * count for s, count in t.size_counts) * gb


def zero_partition(t: Any, config: Any) -> int:
    """Trainable elements in this rank's DeepSpeed partition: one flat tensor of T/N."""
    return math.ceil(t.count / config.gpus)


def comm_bytes(config: Any) -> int:
    """Bytes per element of DeepSpeed's device-side params, gradients and buckets: 16-bit in
    mixed precision (DeepSpeed casts the model), else fp32."""
    return HALF if config.precision.is_mixed else FP32


class ZeRO(ShardingSpec):
    """One DeepSpeed ZeRO stage (``zero_stage``) with its offloads."""

    # ---- words ------------------------------------------------------------------------------
    def label(self, offload: Offload) -> str:
        return self.name + (f"+offload:{offload}" if offload is not _NONE else "")

    def short(self, offload: Offload) -> str:
        return self.name + (f"+{offload}" if offload is not _NONE else "")

    def offload_words(self, offload: Offload) -> str:
        return {Offload.NONE: "no offload", Offload.OPTIMIZER: "optimizer states offloaded to CPU RAM",
                Offload.OPTIMIZER_PARAMS: "optimizer states and parameters offloaded to CPU RAM"}[offload]

    def plan_line(self, offload: Offload) -> str:
        return f"DeepSpeed: {self.words}, {self.offload_words(offload)}"

    def cast_words(self, dtype: str) -> tuple[str, str]:
        # deepspeed/runtime/engine.py _configure_distributed_model: the bf16/fp16 mode casts the
        # model, the optimizer keeps fp32 masters of its partition
        return (f"DeepSpeed's {dtype} mode: {dtype} weights and compute, fp32 master weights in the optimizer partition",
                "loaded in fp32; DeepSpeed casts it to 16-bit and keeps fp32 master weights (ds_config.json)")

    def notes(self, config: Any, offload: Offload, *, host_bytes: int) -> list[str]:
        notes = []
        if config.gpus == 1 and offload is _NONE:
            notes.append(f"{self.words} on one GPU shards nothing; it ranks where it is faster than the plans without "
                         "DeepSpeed or fits where they do not: DeepSpeed keeps the model in 16-bit with the fp32 master in "
                         "the optimizer, which lets a larger micro-batch fit "
                         "(deepspeed runtime/engine.py _configure_distributed_model)")
        if offload is not _NONE:
            notes.append(f"offload: {format_bytes(host_bytes)} pinned host RAM per GPU, step waits on PCIe "
                         "(Ren et al. 2021)")
        return notes

    # ---- validation -------------------------------------------------------------------------
    def refusal(self, config: Any, offload: Offload) -> Callable[[], PlannerError] | None:
        """What DeepSpeed ZeRO does not take (or the memory model does not cover)."""
        stage = self.zero_stage
        if offload not in self.offloads:
            return lambda: InvalidConfigError(
                "--offload optimizer+params needs --zero 3 (only ZeRO-3 partitions parameters)"
            )
        precision = config.precision
        if not precision.is_mixed and precision.weight_bytes == HALF:  # pure fp16/bf16
            return lambda: UnsupportedError(
                f"--precision {precision} with --zero {stage}: DeepSpeed always keeps "
                f"fp32 master weights, use --precision {precision}-mixed"
            )
        optimizer = config.optimizer
        if offload is not _NONE and optimizer not in _OFFLOADABLE:
            return lambda: UnsupportedError(
                f"--offload with --optimizer {optimizer}: DeepSpeed offloads only its "
                f"CPU Adam, use --optimizer {names(_OFFLOADABLE)}"
            )
        if optimizer in _UNPAGED:
            return lambda: UnsupportedError(
                f"--optimizer {optimizer} with --zero: paging and ZeRO partitioning do "
                f"not combine, use {_UNPAGED[optimizer]}"
            )
        if stage == 3 and config.method == "qlora":
            return lambda: UnsupportedError(
                "--method qlora with --zero 3 is not modelled (4-bit weights cannot be "
                "partitioned without quant_storage tricks): use --zero 2 or lower"
            )
        return None

    # ---- memory -----------------------------------------------------------------------------
    def model_states(self, model: Any, config: Any, t: Any, out: dict[str, int], *, param_bytes: int, grads: int,
                     base_sizes: tuple[int, ...]) -> tuple[dict[str, int], int]:
        zero_out, host = self._states(model, config, t, weights=out.get("weights"), param_bytes=param_bytes,
                                      grads=grads, base_sizes=base_sizes)
        if "lora/weights" in out and config.precision.is_mixed:
            out["lora/weights"] = _adapter_weights(model, config, t)
        if "weights" not in zero_out:
            out.pop("weights", None)  # offloaded with the parameters
        out.update(zero_out)
        return out, host

    def _states(self, model: Any, config: Any, t: Any, *, weights: int | None, param_bytes: int, grads: int,
                base_sizes: tuple[int, ...]) -> tuple[dict[str, int], int]:
        """(device bytes by component, host bytes) of the stage's model states. ``weights``: the
        device bytes of the unquantised weights without DeepSpeed (None for 4-bit ones); ``grads``:
        the unpartitioned gradient bytes in the trainable dtype ``param_bytes``. No "weights" key in
        the answer means the weights live on the host."""
        n, gb, full = config.gpus, comm_bytes(config), not config.method.uses_adapters
        offload = config.sharding.offload
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
        if self.zero_stage == 3:
            host += _zero3_weights(model, config, out, base_sizes)
            gathered = zero3_gathered_bytes(model, config, t, base_sizes)
            # On N ranks a parameter gathered in forward stays gathered until its backward has run:
            # it is used again within max_reuse_distance (1e9 elements, DS_MAX_REUSE_DISTANCE) of
            # the trace, so the coordinator does not release it (partitioned_param_coordinator.py
            # l.653-662); the loss' backward (backward_start) runs with them all still live (measured
            # on 2 CPU ranks, llama-8k: the embedding, lm_head and every layer's weights, 11,091,968 B).
            # On one rank only parameter offload gathers, per module (measured: none live there).
            if n > 1:
                out[self.step_key("held")] = gathered - _zero3_released_after_forward(model, config, base_sizes)
            else:
                out[self.step_key("gathered")] = gathered
            # ZeRO-3 allocates the flat 16-bit gradient partition when it is built, so it is alive
            # through the whole step (stage3.py _setup_for_real_optimizer grad_partitions_flat_buffer);
            # with optimizer offload it is built on the host and pinned (deepspeed 0.19.8 stage3.py
            # l.333: self.device = cpu when offload_optimizer; l.791-795: torch.zeros(..., device=
            # self.device), then pin_memory), and partition_grads copies each reduced gradient there
            # (l.2022-2045)
            grad_partitions = grads * gb // param_bytes // n
            if offload is _NONE:
                out["zero3/grad_partitions"] = grad_partitions
            else:
                host += grad_partitions
        else:
            out["gradients"] = grads * gb // param_bytes if self.zero_stage == 1 else grads * gb // param_bytes // n
        # the IPG bucket: one buffer of reduce_bucket_size elements per gradient dtype (stage3.py l.780-784;
        # stage_1_and_2.py's contiguous-gradients ipg buffer alike), the run's file's size (``zero_buckets``)
        out["zero/reduce_bucket"] = _bucket(model, config, "reduce_bucket_size") * gb
        if offload is _NONE:
            # ZeRO-3 in fp32 steps the fp32 partition itself: its master is that tensor (deepspeed
            # 0.19.8 stage3.py l.1163-1168, "we don't need another copy of the weights")
            if self.zero_stage != 3 or config.precision.is_mixed:
                out["master_weights"] = FP32 * trainable // n
            out["optimizer_states"] = states_per_device
            return out, host
        return out, host + self._offload_host(config, t, out, states_per_device)

    def _offload_host(self, config: Any, t: Any, out: dict[str, int], states_per_device: int) -> int:
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
        if self.zero_stage in (1, 2):
            largest = max((n for n, _ in t.size_counts), default=0)
            host += gb * zero_partition(t, config) + gb * largest
            out["zero/offload_grad_buffer"] = gb * largest
        return host

    def optimizer_tensors(self, t: Any, config: Any, param_bytes: int) -> tuple[tuple[tuple[int, int], ...], int] | None:
        # the optimizer steps one flat fp32 partition (see _states); with offload, on the host
        if config.sharding.offload is not _NONE:
            return None
        return ((zero_partition(t, config), 1),), FP32

    def optimizer_gradients(self, t: Any, config: Any, device_grads: int) -> int:
        """With no offload, DeepSpeed flattens this rank's gradients into one fp32 partition
        (stage 1/2: ``single_grad_partition``; stage 3: the fp32 partition's ``.grad``) and frees
        the 16-bit ones before stepping (stage_1_and_2.py step: free_grad_in_param_list). With
        offload the step runs on the host."""
        if config.sharding.offload is not _NONE:
            return 0
        return FP32 * zero_partition(t, config)

    def gradient_flatten(self, t: Any, config: Any) -> int:
        """Without offload, as the step begins: the 16-bit gradients of this rank's partition
        flattened into one tensor and that tensor's fp32 copy, both alive with the 16-bit
        gradients (ZeRO-1/2: stage_1_and_2.py step, flatten_dense_tensors_aligned(...).to(fp32);
        measured on gpt2 with an 8-bit optimizer, whose own step adds nothing the probe sees;
        ZeRO-3: deepspeed 0.19.8 stage3.py l.2686-2687 _prepare_fp32_grad_for_sub_group,
        ``self.flatten(self.averaged_gradients[i]).to(fp32)`` over the views of the flat 16-bit
        gradient partition, which stays). In fp32 the flat copy already is the fp32 partition
        (.to() returns it)."""
        if config.sharding.offload is not _NONE:
            return 0
        partition = zero_partition(t, config)
        return partition * HALF + FP32 * partition if config.precision.is_mixed else FP32 * partition

    def gradient_flatten_tensors(self, t: Any, config: Any) -> tuple[int, ...] | None:
        """The 16-bit flat copy, then its fp32 copy (``gradient_flatten``): 2 and 4 bytes per
        element, not two equal halves; in fp32 the one flat tensor."""
        nbytes = self.gradient_flatten(t, config)
        if not nbytes:
            return None
        partition = zero_partition(t, config)
        return (HALF * partition, FP32 * partition) if config.precision.is_mixed else (nbytes,)

    def step_checks(self, model: Any, t: Any, config: Any) -> tuple[tuple[str, int], ...]:
        """ZeRO-3 without offload, as ``step()`` begins (deepspeed 0.19.8 stage3.py l.2873-2890),
        after the overflow check (``stream_checks``) and before the flatten: the gradient norm
        (l.2889 _get_norm_groups -> get_grad_norm_direct l.2454-2459): each parameter's gradient
        partition ``.to(get_norm_dtype())``, float64 wherever the device has it
        (runtime/zero/utils.py l.59-62), one at a time: eight bytes per element of the largest
        parameter's partition (``zero3/norm_copy``; Qwen1.5-0.5B's embedding, 151936 x 1024
        elements: 1.16 GiB)."""
        if self.zero_stage != 3 or config.sharding.offload is not _NONE or not t.count:
            return ()
        largest = max(math.ceil(n / config.gpus) for n, _ in t.size_counts)
        return (("zero3/norm_copy", 8 * largest),)

    def stream_checks(self, t: Any, config: Any) -> tuple[tuple[str, int], ...]:
        """ZeRO-3 without offload in fp16, first of the step: the overflow check (stage3.py
        l.2815-2816 check_overflow -> has_overflow l.3011-3016), ``torch.isinf(self.
        grad_partitions_flat_buffer).any()`` then ``torch.isnan(...)``, each a bool tensor of one
        byte per element of the 16-bit gradient partition, on the reduce stream
        (``zero3/overflow_check``: its segment stays that stream's). P bytes, never a moment's
        largest (the flatten is 6P), so not in the static terms, which the search shares between
        bf16 and fp16 under DeepSpeed: the timeline draws it for the replay."""
        if self.zero_stage != 3 or config.sharding.offload is not _NONE or config.precision != "fp16-mixed":
            return ()
        return (("zero3/overflow_check", zero_partition(t, config)),)

    def streams(self, config: Any) -> tuple[tuple[str, str], ...]:
        """ZeRO-3's overflow check runs on its reduce stream (``stream_checks``)."""
        return _ZERO3_STREAMS if self.zero_stage == 3 else ()

    def build_sequence(self, model: Any, config: Any, t: Any, resident: dict[str, int]) -> tuple[tuple[Any, ...], ...]:
        """ZeRO-3 without offload, as deepspeed 0.19.8's engine builds it (stage3.py __init__):

        * the 16-bit partition: defragment (runtime/zero/utils.py l.215-243) copies every
          parameter's partition to the host, empties the cache and copies them back as ONE flat
          device buffer (stage3.py l.972): one tensor under full fine-tuning (LoRA's frozen base
          weights are not in it);
        * the fp32 master (l.1168-1172): ``converted = fp16_flat.to(device, fp32)`` then
          ``converted.clone().detach()``: the cast lives beside the master until the function
          returns (``zero3/master_cast``, fp32 of the partition, 16-bit runs only);
        * initialize_optimizer_states (l.1301-1306): a zero fp32 gradient buffer of the largest
          sub-group (``zero3/init_gradient_buffer``), dropped at the end (l.1366-1368); no state
          is made (l.1310-1311: lazy, at the first step, but Adagrad's; ``lazy_states``);
        * the IPG bucket (l.780-784) and the flat 16-bit gradient partition (l.791-793).

        Its freed blocks stay cached: the first step's activations are carved from them."""
        if self.zero_stage != 3 or config.sharding.offload is not _NONE:
            return ()
        partition = zero_partition(t, config)
        seq: list[tuple[Any, ...]] = []
        if "weights" in resident:
            seq.append(("alloc", "weights", resident["weights"], None if config.method.uses_adapters else 1))
        if "lora/weights" in resident:
            seq.append(("alloc", "lora/weights", resident["lora/weights"], None))
        if config.precision.is_mixed:
            seq.append(("alloc", "zero3/master_cast", FP32 * partition, 1))
        seq.append(("alloc", "master_weights", resident.get("master_weights", 0), 1))
        if config.precision.is_mixed:
            seq.append(("free", "zero3/master_cast", FP32 * partition, 1))
        seq += [("alloc", "zero3/init_gradient_buffer", FP32 * partition, 1),
                ("free", "zero3/init_gradient_buffer", FP32 * partition, 1)]
        for key in ("zero/reduce_bucket", "zero3/grad_partitions"):
            seq.append(("alloc", key, resident.get(key, 0), 1))
        return tuple(seq)

    def lazy_states(self, config: Any) -> bool:
        """ZeRO-3's optimizer makes its states in the first ``step()`` (deepspeed 0.19.8 stage3.py
        l.1310-1311: "lazy initialization of the state at the first call to step", Adagrad
        excepted); ZeRO-1/2 here as they were measured (states resident from the start)."""
        return self.zero_stage == 3 and config.sharding.offload is _NONE

    def fused_step(self, config: Any, kernels: Any) -> bool:
        """A run whose own ds_config has an Adam/AdamW section without ``torch_adam`` (its
        ``buffers`` say ``torch_adam: 0``) steps DeepSpeed's FusedAdam on a GPU (deepspeed 0.19.8
        runtime/engine.py l.2378-2380: torch_adam defaults to False, then FusedAdam, l.2402-2403):
        one multi-tensor kernel, no foreach temporaries. The planner's own file sets torch_adam
        (``planner.optim.adamw.deepspeed_section``); with offload the step runs on the host."""
        buffers = dict(config.sharding.buffers or ())
        return (buffers.get("torch_adam") == 0 and config.sharding.offload is _NONE and kernels.caching_allocator
                and config.optimizer == "adamw")

    def memory_twin(self, gpus: int) -> str:
        # ZeRO-2 on one GPU partitions gradients over one rank, as ZeRO-1 does
        return "zero1" if self.zero_stage == 2 and gpus == 1 else self.name

    # ---- throughput -------------------------------------------------------------------------
    def comm_bytes(self, config: Any, *, trainable: int, params_total: int, grad_bytes: int) -> float:
        """Bytes each rank sends per optimizer step (ring collectives). DeepSpeed communicates in
        the model dtype (``communication_data_type`` defaults to fp16/bf16, deepspeed/runtime/
        engine.py); fp32 training sends 4 B.

        * ZeRO-1: reduce-scatter of gradients and all-gather of the updated 16-bit params once per
          step: 2·(n-1)/n · trainable · comm bytes (ZeRO paper, Rajbhandari et al. 2020, sec. 7: 2Ψ).
        * ZeRO-2: the gradient reduce-scatter runs every micro-step (gradients are partitioned as
          they are produced), the param all-gather once per step.
        * ZeRO-3: every micro-step all-gathers ALL parameters for the forward, the backward and the
          checkpoint recompute, and reduce-scatters the gradients (ZeRO paper sec. 7.2.2: 3Ψ).
        """
        f = ring(config.gpus)
        cb = config.precision.compute_bytes
        if self.zero_stage == 1:
            return 2 * f * trainable * cb
        if self.zero_stage == 2:
            return f * trainable * cb * (config.grad_accum + 1)
        gathers = 2 + int(config.grad_ckpt)
        per_micro = f * cb * (gathers * params_total + trainable)
        return per_micro * config.grad_accum

    def offload_bytes(self, config: Any, offload: Offload, *, trainable: int, params_total: int) -> float:
        """Ren et al. 2021 (ZeRO-Offload, sec. 4): 16-bit gradients go device->host, the CPU
        updates the fp32 master copy, 16-bit parameters come back. With ZeRO-2/3 the gradient
        partition is copied at every micro-step (it is reduced every micro-step), with ZeRO-1 once
        per step. With parameter offload (ZeRO-3 ``optimizer+params``) the parameters live on the
        host and stream in for every forward, backward and recompute; no separate copy back after
        the update. Each device moves only its 1/n partition."""
        if offload is _NONE:
            return 0.0
        n = config.gpus
        cb = config.precision.compute_bytes
        partition = trainable / n
        grad_copies = config.grad_accum if self.zero_stage >= 2 else 1
        total = partition * cb * grad_copies
        if offload is _OPTIMIZER:
            total += partition * cb
        else:
            gathers = 2 + int(config.grad_ckpt)
            total += gathers * (params_total / n) * cb * config.grad_accum
        return total

    def master_update_bytes(self, config: Any) -> float:
        """DeepSpeed keeps an fp32 master copy for 16-bit training: +4 B read of the master and
        +2 B write of the 16-bit model weight per parameter (``_update_fp16``-style copy back)."""
        return 4 + 2 if config.precision.is_mixed else 0

    # ---- files ------------------------------------------------------------------------------
    def emitted_files(self, config: Any, *, hidden_size: int, pin_memory: bool = False,
                      gradient_clipping: float | None = None, hyperparameters: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """``ds_config.json``, the DeepSpeed config both the measurement worker
        (``deepspeed.initialize(config=...)``) and ``planner emit`` (for the HF Trainer) use, so the
        run that was measured and the run the user launches use the same buckets. Keys follow
        DeepSpeed's config reference (https://www.deepspeed.ai/docs/config-json/,
        deepspeed/runtime/zero/config.py in 0.19).

        ``hidden_size`` sizes the communication buckets. ``pin_memory``: page-lock offloaded
        buffers (faster H2D copies on a GPU; False on the CPU, where there is nothing to copy to).
        ``train_batch_size`` is left out so DeepSpeed derives it from the world size (micro batch x
        accumulation x ranks). ``gradient_clipping``: the norm DeepSpeed clips gradients to (None:
        the key is left out, DeepSpeed does not clip). ``hyperparameters``: the optimizer's ``lr``,
        ``betas``, ``eps`` and ``weight_decay``."""
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise InvalidConfigError(f"hidden_size must be a whole number >= 1 (the model's hidden size), got {hidden_size!r}")
        offload = config.sharding.offload
        # the bucket sizes the memory terms assume (the HF Trainer's "auto" values), not
        # DeepSpeed's 5e8-element defaults, which would hold ~1 GB of 16-bit buffers on a small model
        buckets = deepspeed_buckets(hidden_size)
        zero: dict[str, Any] = {"stage": self.zero_stage, "reduce_bucket_size": buckets["reduce_bucket_size"]}
        if self.zero_stage in (1, 2):
            zero["allgather_bucket_size"] = buckets["allgather_bucket_size"]
        else:
            zero["stage3_prefetch_bucket_size"] = buckets["stage3_prefetch_bucket_size"]
            zero["stage3_param_persistence_threshold"] = buckets["stage3_param_persistence_threshold"]
        if offload is not _NONE:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
        if offload is _OPTIMIZER_PARAMS:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
        ds: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": config.micro_batch,
            "gradient_accumulation_steps": config.grad_accum,
            "zero_optimization": zero,
            # DeepSpeed keeps fp32 master weights itself: *-mixed maps to its bf16/fp16 mode
            # (check refuses pure 16-bit with ZeRO).
            "bf16": {"enabled": config.precision == "bf16-mixed"},
            "fp16": {"enabled": config.precision == "fp16-mixed"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if gradient_clipping is not None:
            ds["gradient_clipping"] = gradient_clipping
        section = OPTIMIZERS[config.optimizer].deepspeed_section
        if section is not None:
            # DeepSpeed builds the optimizer itself from this section (with offload, its CPU optimizer)
            ds["optimizer"] = section(**hyperparameters, offload=offload is not _NONE)
        else:
            # the others are passed to deepspeed.initialize as client optimizers, which ZeRO refuses
            # unless told (engine.py _do_optimizer_sanity_check)
            ds["zero_allow_untested_optimizer"] = True
        return {DEEPSPEED_FILE: ds}

    def training_arguments(self, config: Any) -> dict[str, Any]:
        return {"deepspeed": DEEPSPEED_FILE}

    def accelerate(self, config: Any, *, on_cpu: bool) -> dict[str, Any]:
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_config_file": DEEPSPEED_FILE,
            # ZeRO-3 builds the model already partitioned (deepspeed.zero.Init)
            "zero3_init_flag": self.zero_stage == 3,
        }}

    # ---- the worker -------------------------------------------------------------------------
    def worker_init(self, device: str) -> None:
        """DeepSpeed picks its accelerator once, when it is imported (DS_ACCELERATOR), then joins
        the process group through its own init (``deepspeed.init_distributed``)."""
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        join_process_group(device, init=lambda backend: deepspeed.init_distributed(dist_backend=backend))

    def worker_setup(self, model: Any, params: list, config: Any, *, device: str,
                     build_optimizer: Callable[[list], Any], hidden_size: int,
                     hyperparameters: dict[str, Any]) -> WorkerSetup:
        """``deepspeed.initialize`` with this scheme's ``ds_config.json`` (the one ``planner emit``
        writes): DeepSpeed builds the optimizer from its section, or takes the client's."""
        import deepspeed

        ds_config = self.emitted_files(config, hidden_size=hidden_size, pin_memory=device != "cpu",
                                       hyperparameters=hyperparameters)[DEEPSPEED_FILE]
        client = None if "optimizer" in ds_config else build_optimizer(params)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client,
                                                       config=ds_config)
        return WorkerSetup(engine=engine, optimizer=optimizer, autocast=False, engine_steps=True,
                           details={"deepspeed_config": ds_config})


def _zero3_weights(model: Any, config: Any, out: dict[str, int], base_sizes: tuple[int, ...]) -> int:
    """Splits ``out["weights"]`` (the whole model's weights, frozen LoRA base weights included)
    into what ZeRO-3 keeps on this device and returns the host bytes: every rank holds 1/N of
    the partitioned parameters (on the host with parameter offload) and the persistent ones whole
    (``zero3_param_split``)."""
    if "weights" not in out:
        return 0
    per_element = out["weights"] / model.params_total
    base_persistent = zero3_param_split(base_sizes, (), _bucket(model, config, "stage3_param_persistence_threshold"))[1]
    partition = int((model.params_total - base_persistent) * per_element) // config.gpus
    persistent = int(base_persistent * per_element)
    if config.sharding.offload is _OPTIMIZER_PARAMS:
        out["weights"] = persistent
        return partition
    out["weights"] = partition + persistent
    return 0


#: ZeRO-3's keys allocated on a side stream (``ZeRO.streams``): the overflow check, on the reduce stream
_ZERO3_STREAMS = (("zero3/overflow_check", "reduce"),)
#: the breakdown keys of ZeRO's partitions and buffers: flat tensors, one each (stage_1_and_2.py and
#: stage3.py allocate each as one buffer), but the gathered parameters and the step's gradient copies
_KEYS = (
    BreakdownKey("master_weights", "weights", tensors=1),
    BreakdownKey("zero3/gathered_params", "weights", size="gathered"),
    BreakdownKey("zero3/gathered_params_kept", "weights", size="held"),
    BreakdownKey("zero3/grad_partitions", "gradients", tensors=1),
    BreakdownKey("zero/reduce_bucket", "gradients", tensors=1),
    BreakdownKey("zero/offload_grad_buffer", "gradients", tensors=1),
    BreakdownKey("zero/gradient_flatten", "temporaries", size="gradient_flatten"),
    BreakdownKey("zero3/overflow_check", "temporaries", tensors=1),
    BreakdownKey("zero3/norm_copy", "temporaries", tensors=1),
    BreakdownKey("zero3/master_cast", "weights", tensors=1),
    BreakdownKey("zero3/init_gradient_buffer", "gradients", tensors=1),
)
_COMMON = dict(searched=True, library="deepspeed", casts_model=True, flat_optimizer=True, partitions_optimizer=True,
               keys=_KEYS,
               plan_notes=("DeepSpeed buckets as in ds_config.json (reduce bucket hidden², not DeepSpeed's 5e8 default)",))
SPECS = (
    ZeRO(name="zero1", order=2, zero_stage=1, offloads=(Offload.NONE, Offload.OPTIMIZER),
         words="ZeRO-1", **_COMMON),
    ZeRO(name="zero2", order=3, zero_stage=2, offloads=(Offload.NONE, Offload.OPTIMIZER),
         words="ZeRO-2", **_COMMON),
    # measured on 2 CPU ranks (llama-8k, LoRA all-linear): the frozen lm_head keeps its input,
    # the final norm's bf16 output (131,072 B), through the mem-efficient linear ZeRO-3 swaps in
    ZeRO(name="zero3", order=4, zero_stage=3, offloads=(Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS),
         partial_head="--fused-ce with --zero 3: the fused loss reads lm_head.weight outside the module's forward, "
                      "where ZeRO-3 holds only a partition (Liger's fused_linear_cross_entropy_forward refuses it): "
                      "use --zero 2 or lower",
         words="ZeRO-3", linear_saves_input=True, **_COMMON),
)

__all__ = ["DEEPSPEED_FILE", "DS_DEFAULTS", "DS_MAX_LIVE_PARAMETERS", "DS_MAX_REUSE_DISTANCE", "SPECS", "ZeRO", "comm_bytes", "deepspeed_buckets",
           "persistence_threshold", "reduce_bucket_size", "zero3_gathered_bytes", "zero3_live_params",
           "auto_bucket_keys", "users_buffers", "users_sharding", "zero3_param_split", "zero_buckets", "zero_partition"]
