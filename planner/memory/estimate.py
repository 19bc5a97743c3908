"""``estimate_memory``: the peak of one configuration on one device, with its named breakdown.

Read from the step's timeline (``planner.memory.timeline``); on a device with PyTorch's caching
allocator the timeline's allocations are replayed on a model of it (``planner.memory.allocator``)
for the peak reserve and the fragmentation at the peak.
"""

from __future__ import annotations

from typing import Callable

from planner.config import Method, TrainConfig
from planner.memory.activations import ACTIVATION_SAVED
from planner.memory.allocator import AllocatorConfig, Replay, replay, shared_prefixes, stream_name
from planner.memory.attention import effective_attention
from planner.memory.evaluation import eval_note
from planner.memory.overhead import outside_allocator, overhead_notes, paged_on_host, with_workspaces
from planner.memory.timeline import Timeline, step_timeline
from planner.modelspec import ModelSpec
from planner.results import MemoryEstimate
from planner.units import format_bytes


def _assumptions(model: ModelSpec, config: TrainConfig, gpu, timeline: Timeline, replayed: Replay | None,
                 paged_host: int = 0) -> list[str]:
    out = []
    if replayed is None:
        out.append("cpu profile: live tensor bytes; no caching allocator, no CUDA context")
    else:
        if timeline.paged:
            out.append(_paged_note(timeline, gpu, paged_host))
        conf = AllocatorConfig.parse(config.alloc_conf)
        out.append(f"allocator: PyTorch's CUDA caching allocator replayed on the step's allocations "
                   f"({conf.spelling() or 'default settings'}; {_streams_words(config, timeline)}, tensors of a term taken "
                   "as equal)")
        out.extend(overhead_notes(gpu, config))
        if conf.ignored:
            out.append(f"allocator settings not modelled: {', '.join(conf.ignored)}")
        if replayed.out_of_memory:
            out.append(f"the allocator replay runs out of device memory at: {replayed.out_of_memory}")
        elif replayed.filled:
            # CUDACachingAllocator.cpp malloc: a failed cudaMalloc releases every cached free segment
            # (release_cached_blocks, a device sync and a cudaFree each) and retries (num_alloc_retries)
            out.append(f"the caching allocator's reserve reaches the memory the plan is replayed within at "
                       f"{format_bytes(replayed.filled)}: past it a cudaMalloc fails, and the allocator frees every cached "
                       "free segment (a device sync, a cudaFree each) and retries (num_alloc_retries > 0), holding "
                       f"{format_bytes(replayed.peak_reserved)} after; where the device has more room it may keep up to "
                       f"{format_bytes(replayed.filled)} reserved")
    if model.hidden_act not in ACTIVATION_SAVED:
        out.append(f"activation {model.hidden_act!r} is not in the model's table: assumed to save its input like a fused kernel")
    if effective_attention(model, config) is not config.attention:
        out.append(f"attention: {model.model_type} has no SDPA path in transformers: planned as the eager attention "
                   "that runs (attn_implementation='eager', as its published recipe loads it)")
    if model.is_encoder_decoder and not config.builds_kv_cache and not config.grad_ckpt:
        # transformers T5ForConditionalGeneration.__init__ deep-copies the config for its decoder
        # (KV cache on) and T5Stack.forward reads it there (merge_with_config_defaults)
        out.append("not counted: under the HF Trainer, which turns the KV cache off on the model's config only, the "
                   "decoder's own config copy keeps it on in training (measured +1.0 % on a 2-layer T5 at bf16-mixed); "
                   "turn it off in the forward's arguments, or checkpoint, to train without it")
    if config.evaluates:
        curve = timeline.curve()
        out.append(eval_note(config, {name: curve[mark] for name, mark in timeline.marks.items()}))
    out.extend(model.training_notes)
    if model.lora_refused and config.method.uses_adapters:
        out.append(f"LoRA on {','.join(config.lora_targets or ())}: every linear but {'/'.join(model.lora_refused)} "
                   f"({model.lora_refused_why}), all-linear's default named")
    if config.method is Method.QLORA:
        out.append("NF4 with double quantisation, blocksize 64; " + (
            "non-4-bit params upcast to fp32 by prepare_model_for_kbit_training" if config.kbit_upcast
            else "non-4-bit params kept in the 16-bit compute dtype (no k-bit upcast, --no-kbit-upcast)"))
    return out


def _streams_words(config: TrainConfig, timeline: Timeline) -> str:
    """The side streams the replay keeps apart (``ShardingSpec.streams``) whose keys the step
    allocates, as the assumption names them."""
    made = {event[1] for event in timeline.events}
    named: dict[str, list[str]] = {}
    for key, stream in config.sharding.spec.streams(config):
        if key in made:
            named.setdefault(stream_name(stream), []).append(key)
    if not named:
        return "one stream"
    return "a pool per stream (" + "; ".join(f"{', '.join(keys)} on the {stream} stream"
                                            for stream, keys in named.items()) + ")"


def _paged_note(timeline: Timeline, gpu, paged_host: int) -> str:
    from planner.units import format_bytes

    where = (f"{format_bytes(paged_host)} of them stay on the host, migrated in and out over the "
             f"{gpu.host_link_gbs:g} GB/s host link each step (in the step time)" if paged_host
             else "all of them fit beside the allocator's reserve")
    return (f"paged optimizer states: {format_bytes(timeline.paged)} in unified memory, outside the allocator "
            f"(bitsandbytes get_paged); the process total holds the largest tensor's, "
            f"{format_bytes(timeline.outside_allocator)}, on the device while it steps; {where}")


def device_timeline(*, model: ModelSpec, config: TrainConfig, gpu, step: Timeline | None = None) -> Timeline:
    """The step's timeline on ``gpu``: ``step_timeline`` of its kernel profile (``step``, where the
    caller has it already), with the cuBLAS workspaces where the caching allocator holds them.
    What it reads of the device: ``gpu.kernels`` and, for the workspaces, its compute capability
    (``overhead.cublas_workspace_bytes``); not its memory."""
    timeline = step if step is not None else step_timeline(model=model, config=config, kernels=gpu.kernels)
    return with_workspaces(timeline, gpu) if gpu.kernels.caching_allocator else timeline


def known_to_run_out(config: TrainConfig, gpu, budget: int) -> Callable[[list, list[int], int], bool] | None:
    """``step_timeline``'s ``abandon`` for a plan dropped where its allocator replay on ``budget``
    runs out (``replay_timeline(measure=False)`` None): whether the replays of this search
    (``allocator.shared_prefixes``) have run out in the events a timeline begins with, as its replay
    would (``ReplayPrefixes.ran_out``), with what ``device_timeline`` puts before them. None where
    nothing is replayed or no replays are shared."""
    prefixes = shared_prefixes()
    if prefixes is None or not gpu.kernels.caching_allocator:
        return None
    before = with_workspaces(Timeline(events=()), gpu).events  # (the events the device adds first)
    settings, streams = AllocatorConfig.parse(config.alloc_conf), config.sharding.spec.streams(config)

    def abandon(events: list, forks: list[int], outside: int) -> bool:
        return prefixes.ran_out((*before, *events), [fork + len(before) for fork in forks],
                                capacity=_capacity(outside, config, gpu, budget), config=settings,
                                streams=streams) is not None

    return abandon


def replay_capacity(timeline: Timeline, config: TrainConfig, gpu, budget: int | None = None) -> int:
    """The bytes the caching allocator has on ``gpu`` (``replay_timeline``)."""
    return _capacity(timeline.outside_allocator, config, gpu, budget)


def _capacity(outside: int, config: TrainConfig, gpu, budget: int | None) -> int:
    """``replay_capacity`` of a timeline whose ``outside_allocator`` is ``outside``."""
    return (budget or gpu.memory_bytes) - outside_allocator(gpu, config.gpus) - outside


def replay_timeline(timeline: Timeline, config: TrainConfig, gpu, trace: list[int] | None = None,
                    budget: int | None = None, measure: bool = True) -> Replay | None:
    """The caching allocator over the timeline, on what the device leaves it (its memory, or the
    ``budget`` a plan must fit in, less the CUDA context, NCCL's buffers and the memory outside the
    allocator, ``planner.memory.overhead``);
    ``trace`` gets the reserve after each event. On a budget the allocator does what it does on a
    device that size: a cudaMalloc past it fails, and it frees cached blocks and retries
    (CUDACachingAllocator.cpp ``malloc``: ``alloc_block`` || ``release_available_cached_blocks``
    && ``alloc_block`` || ``release_cached_blocks`` && ``alloc_block``); only a request no release
    can place is out of memory. ``measure`` False: None where the step runs out of memory, not the
    reserve it would need (``planner.memory.allocator.replay``)."""
    return replay(timeline.events, capacity=replay_capacity(timeline, config, gpu, budget),
                  config=AllocatorConfig.parse(config.alloc_conf), trace=trace,
                  streams=config.sharding.spec.streams(config), forks=timeline.forks, measure=measure)


def estimate_memory(*, model: ModelSpec, config: TrainConfig, gpu, budget: int | None = None,
                    timeline: Timeline | None = None, replayed: Replay | None = None) -> MemoryEstimate:
    """Predict peak memory per device for one configuration on one GPU (or the ``cpu`` profile).

    ``budget``: the bytes the process may use (the usable memory a plan must fit in; default the
    device's): the allocator is replayed on it, so a cache that would grow past it is released
    as the real allocator releases it when the device is full, and the process total exceeds it
    only when the step cannot run in it. ``timeline`` and ``replayed``: ``device_timeline`` and its
    ``replay_timeline`` on this budget, where the caller has them (``planner.search.shared_estimate``
    shares them between devices); computed here otherwise."""
    if timeline is None:
        timeline = device_timeline(model=model, config=config, gpu=gpu)
    if not gpu.kernels.caching_allocator:
        replayed = None
    elif replayed is None:
        replayed = replay_timeline(timeline, config, gpu, budget=budget)
    return ReplayedTotals(model, config, gpu, timeline, replayed).estimate()


class ReplayedTotals:
    """What ``estimate_memory`` says of the process total and the paged states (``process_total_bytes``,
    ``paged_bytes``, ``paged_host_bytes``, as ``MemoryEstimate`` names them), worked out from a timeline and its
    replay (None: no caching allocator) before the rest of the estimate, which ``estimate()`` makes: the
    search reads these alone of the plans its replays drop or find near the edge (``planner.search.shared_estimate``)."""

    __slots__ = ("_args", "process_total_bytes", "paged_bytes", "paged_host_bytes", "_made")

    def __init__(self, model: ModelSpec, config: TrainConfig, gpu, timeline: Timeline, replayed: Replay | None) -> None:
        self._args, self._made = (model, config, gpu, timeline, replayed), None
        if replayed is None:
            total = timeline.peak
        else:
            total = replayed.peak_reserved + outside_allocator(gpu, config.gpus) + timeline.outside_allocator
        self.process_total_bytes, self.paged_bytes = total, timeline.paged
        self.paged_host_bytes = paged_on_host(timeline.paged, required=timeline.outside_allocator,
                                              device=gpu.memory_bytes, total=total)

    def estimate(self) -> MemoryEstimate:
        """The whole ``MemoryEstimate`` (made once)."""
        if self._made is None:
            self._made = self._estimate()
        return self._made

    def _estimate(self) -> MemoryEstimate:
        model, config, gpu, timeline, replayed = self._args
        peak = timeline.peak
        if replayed is None:
            reserved, fragmentation = peak, 0
        else:
            assert replayed.allocated_peak == peak, (replayed.allocated_peak, peak)
            reserved, fragmentation = replayed.peak_reserved, replayed.fragmentation
        return MemoryEstimate(
            peak_allocated_bytes=peak,
            peak_reserved_bytes=reserved,
            process_total_bytes=self.process_total_bytes,
            cpu_bytes=timeline.host,
            breakdown=timeline.breakdown(),
            peak_phase=timeline.peak_phase,
            assumptions=tuple(_assumptions(model, config, gpu, timeline, replayed, self.paged_host_bytes)),
            fragmentation_bytes=fragmentation,
            paged_bytes=self.paged_bytes,
            paged_host_bytes=self.paged_host_bytes,
        )


__all__ = ["ReplayedTotals", "device_timeline", "estimate_memory", "known_to_run_out", "replay_capacity", "replay_timeline"]
