"""The search space and its screen: every training configuration that reaches a target global
batch, and which of them fit.

The space: precision x method (full, LoRA and QLoRA with r in {8, 16, 32, 64} on the attention
projections or every linear) x gradient checkpointing x micro-batch (micro x accumulation x
GPUs = target batch) x optimizer x sharding (``planner.sharding.search_axis``: none/DDP, DeepSpeed
ZeRO 1-3 with CPU offload). ``screen`` predicts each
candidate with the memory model's affine fast path (``MemoryMemo``) and ``planner.throughput``,
and keeps every combination's largest split whose process total stays under the usable memory
and whose offloaded states fit the node's host RAM, and each family's closest miss;
``planner.ranking`` ranks what fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import repeat
from operator import add, attrgetter, mul
from typing import Iterator, NamedTuple

from planner import __version__, request
from planner.config import ALL_LINEAR, Method, Optimizer, Precision, TrainConfig, check_context
from planner.errors import InvalidConfigError, PlannerError
from planner.gpus import GPUSpec, check_precision
from planner.host import host_reserve
from planner.limits import check_gpu_count
from planner.memory.allocator import Replay, allocation_size, kLargeBuffer
from planner.memory.dtypes import mode_of
from planner.memory.estimate import ReplayedTotals, device_timeline, known_to_run_out, replay_capacity, replay_timeline
from planner.memory.overhead import cublas_workspace_bytes, paged_on_host
from planner.memory.parameters import Trained, trained
from planner.memory.reserve import largest_peak, peak_independent, process_total
from planner.memory.states import StaticTerms, static_terms
from planner.memory.step import (
    batch_line,
    batch_line_pair,
    first_block_gradients,
    first_block_params,
    line_reads,
    static_parts,
)
from planner.memory.timeline import Timeline, step_timeline
from planner.modelspec import LinearKind, ModelSpec
from planner.optim import SEARCHED
from planner.results import MemoryEstimate, PlanRequest
from planner.sharding import search_axis
from planner.throughput import ThroughputMemo, tokens_per_second
from planner.tradeoffs import Prefer
from planner.uncertainty import safe_total, spread
from planner.units import MiB

LORA_RANKS = (8, 16, 32, 64)
#: Keep this much of the device free: the allocator's fragmentation varies run to run and the
#: DataLoader/NCCL add buffers we do not model. 5% of the device, at least 512 MiB (stated
#: assumption, shown with every plan).
SAFETY_FRACTION = 0.05
SAFETY_MIN = 512 * MiB
#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and the search reads it thousands of times a search
_QLORA = Method.QLORA


@dataclass(frozen=True, kw_only=True)
@request.with_recipe_fields
class SearchSpace:
    """What ``suggest`` may vary. Every field narrows the space; the defaults search it all."""

    methods: tuple[Method, ...] = (Method.FULL, Method.LORA, Method.QLORA)
    """Methods to consider."""
    precisions: tuple[Precision, ...] | None = None
    """None: fp32 and, in 16 bits, bf16-mixed and pure bf16 where the GPU has bf16, else
    fp16-mixed and pure fp16 (``_precisions``). Precisions the GPU cannot run are skipped, with a
    warning; when none is left, ``suggest`` refuses the space with the fix."""
    optimizers: tuple[Optimizer, ...] = SEARCHED
    """The optimizers tried (default: the registry's ``SEARCHED``, those that take AdamW's recipe)."""
    allow_offload: bool = True
    """Consider DeepSpeed CPU offload (bounded by ``cpu_mem_bytes``)."""
    cpu_mem_bytes: int = 0
    """Host RAM of the node (--cpu-mem, or the standard machine's): every rank's offloaded states
    and pinned buffers together must fit in it after ``host_reserve`` (0: no offload plan fits)."""
    host_ram_source: str = "--cpu-mem"
    """Where ``cpu_mem_bytes`` comes from, said with the plan; "" when the node's RAM is not
    known (offload plans are refused with a reason that asks for --cpu-mem)."""
    prefer: Prefer = Prefer.FIDELITY
    """The ranking policy (``planner.tradeoffs.Prefer``)."""
    lora_ranks: tuple[int, ...] = LORA_RANKS
    """LoRA ranks to try, each a whole number >= 1."""
    schemes: tuple[str, ...] | None = None
    """The sharding schemes tried (``planner.sharding.Scheme`` names; None: every one the GPU
    count takes). ``planner check`` narrows it to those its files can say."""
    # then the recipe settings (``planner.request.RECIPE``), fixed by the user and given to every
    # candidate (``TrainConfig``'s fields of the same names; those of LoRA only to LoRA/QLoRA's,
    # those of QLoRA only to QLoRA's: ``request.recipe_for``)

    def recipe(self, method: Method) -> dict:
        """The fixed recipe settings of a candidate of ``method``."""
        return request.recipe_for(request.recipe_of(self), adapters=method.uses_adapters, qlora=method is _QLORA)

    def __post_init__(self) -> None:
        if not self.methods or not self.optimizers:
            raise InvalidConfigError("the search space needs at least one method and one optimizer")
        if not self.lora_ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.lora_ranks):
            raise InvalidConfigError(f"LoRA ranks must be whole numbers >= 1, got {self.lora_ranks!r}")
        if isinstance(self.cpu_mem_bytes, bool) or not isinstance(self.cpu_mem_bytes, int) or self.cpu_mem_bytes < 0:
            raise InvalidConfigError(f"cpu_mem_bytes must be a whole number >= 0, got {self.cpu_mem_bytes!r}")
        try:
            object.__setattr__(self, "prefer", Prefer(self.prefer))
        except ValueError:  # the wording of every bad choice (planner.errors.choice)
            raise InvalidConfigError(f"--prefer must be one of {'|'.join(p.value for p in Prefer)}, "
                                     f"got {self.prefer!r}") from None
        # the recipe settings, checked as TrainConfig checks them with each method searched: a
        # recipe no method takes is the user's mistake, said as estimate says it (exit 2), not
        # "no configuration of the searched space is valid" (exit 3)
        given = request.changed(request.recipe_of(self))
        taken = [self.recipe(method) for method in self.methods]
        untaken = {name: value for name, value in given.items() if all(r[name] != value for r in taken)}
        if untaken:  # a setting of LoRA (QLoRA) alone with no such method searched
            TrainConfig(method=self.methods[0], **untaken)  # raises the LoRA-only (QLoRA-only) line
        refusals = []
        for method in self.methods:
            try:
                TrainConfig(method=method, **self.recipe(method))
                break
            except PlannerError as exc:  # InvalidConfigError or UnsupportedError
                refusals.append(exc)
        else:
            raise refusals[0]

    def offload_budget(self, ranks: int) -> int:
        """Host bytes one rank's offload may use: the node's RAM less ``host_reserve``, shared by
        its ranks (each holds the same share: ZeRO partitions evenly)."""
        return max(self.cpu_mem_bytes - host_reserve(self.cpu_mem_bytes, ranks), 0) // ranks


def safe_bound(method: Method, gpu: GPUSpec, gpus: int = 1) -> int:
    """The largest process total of a plan of ``method`` on ``gpus`` of ``gpu`` that is not near the
    edge of one (``planner.uncertainty.safe_total`` with the method's measured spread)."""
    return safe_total(gpu.memory_bytes, spread(method, gpus=gpus))


def safety_margin(capacity: int) -> int:
    return max(int(capacity * SAFETY_FRACTION), SAFETY_MIN) if capacity > 4 * SAFETY_MIN else capacity // 10


#: Sequences per optimizer step beyond any fine-tuning recipe (Llama-2's pre-training used 1,024
#: sequences of 4k tokens per step); a larger --target-batch is taken for a typo.
MAX_TARGET_BATCH = 1 << 20


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def attention_targets(model: ModelSpec) -> tuple[str, ...]:
    return tuple(dict.fromkeys(lin.name for lin in model.layer_linears if lin.kind in (LinearKind.ATTN_IN, LinearKind.ATTN_OUT)
                               and lin.name not in model.lora_refused))


def _precisions(gpu: GPUSpec, space: SearchSpace) -> tuple[Precision, ...]:
    """fp32 and the 16-bit precisions of one 16-bit type: bf16 where the GPU has it (its exponent
    range is fp32's, so it needs no loss scaling, and every bf16 GPU of the catalog runs bf16 and
    fp16 at the same rate: bf16-mixed and fp16-mixed plans would be predicted alike), else fp16.
    Pure 16-bit is searched too: for LoRA it is the usual recipe (16-bit frozen base, fp32
    adapters); for full fine-tuning it ranks last under --prefer fidelity (``fidelity_tier``).
    The space's own precisions: those the GPU runs (bf16 needs compute capability 8.0; its
    matmuls would have no rate to predict with); a space with none of them is the user's mistake."""
    if space.precisions is not None:
        runs = tuple(p for p in space.precisions if gpu.supports(p))
        if not runs:
            check_precision(gpu, space.precisions[0])  # raises the line that names the fix
        return runs
    if gpu.supports(Precision.BF16):  # + torchao's float8 linears where the GPU has FP8 (config.Precision.FP8)
        return (Precision.FP32, Precision.BF16_MIXED, Precision.BF16) + ((Precision.FP8,) if gpu.fp8 else ())
    return (Precision.FP32, Precision.FP16_MIXED, Precision.FP16)


def enumerate_configs(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int, space: SearchSpace) -> Iterator[TrainConfig]:
    """Every valid configuration of the space (invalid combinations are skipped, not errors)."""
    for base, splits in _combinations(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space):
        for micro, accum in splits:
            yield base.with_split(micro_batch=micro, grad_accum=accum)


class _Knobs(NamedTuple):
    """One valid (method, precision, optimizer, sharding) of the space."""

    config: TrainConfig
    """Validated, with the whole per-device batch as its micro-batch, no checkpointing and its
    row's first adapter variant."""
    family: tuple
    """``family_key``."""
    static_prefix: tuple
    """``_static_key`` less the adapter fields it ends with: knobs of one prefix share their
    static terms per adapter variant."""
    batch_prefix: tuple
    """``_batch_key`` less the adapter and checkpointing fields it ends with: knobs of one prefix share their
    batch lines per adapter variant and checkpointing."""

    def variant(self, lora: tuple[int | None, tuple[str, ...] | None], first: bool) -> TrainConfig:
        """This combination with an adapter variant of its row (``first``: the row's first,
        which ``config`` has)."""
        return self.config if first else self.config.with_lora(lora_r=lora[0], lora_targets=lora[1])


class _Row(NamedTuple):
    """The valid knobs of one method and precision, in the order the space lists optimizers and
    then shardings, and the adapter variants each combines with ([(None, None)] for
    full fine-tuning)."""

    variants: list[tuple[int | None, tuple[str, ...] | None]]
    knobs: list[_Knobs]


def _per_device_splits(target_batch: int, gpus: int) -> list[tuple[int, int]]:
    """Every (micro, accumulation) split of the per-device batch, in ascending micro-batch order."""
    if target_batch % gpus:
        raise InvalidConfigError(
            f"--target-batch {target_batch} cannot be split over {gpus} GPUs (micro x accumulation x GPUs "
            f"= batch): use a multiple of {gpus}"
        )
    per_device = target_batch // gpus
    return [(micro, per_device // micro) for micro in divisors(per_device)]


def _rows(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int,
          space: SearchSpace) -> list[_Row]:
    """The space's valid knobs, a row per method and precision (of the device, they read its
    precisions and whether it is the cpu profile: ``_shared_rows``). Each (method, precision,
    optimizer, sharding) is validated once, with the first adapter variant: the same refusal
    holds for every variant (SearchSpace checked the ranks; the targets are the model's), and the
    others are copies (``with_lora``)."""
    per_device = _per_device_splits(target_batch, gpus)[-1][0]
    lora_variants: list[tuple[int | None, tuple[str, ...] | None]] = []
    attn = attention_targets(model)
    for r in space.lora_ranks:
        # every linear peft wraps, by name where peft refuses all-linear on the model type (ModelSpec.lora_refused)
        lora_variants.append((r, model.peft_linear_names if model.lora_refused else (ALL_LINEAR,)))
        if attn:
            lora_variants.append((r, attn))
    # on the cpu profile the host is the device: an offload moves nothing off it, so none is searched
    shardings = search_axis(allow_offload=space.allow_offload and not gpu.is_cpu, gpus=gpus, schemes=space.schemes)
    rows = []
    for method in space.methods:
        variants = [(None, None)] if method is Method.FULL else lora_variants
        r, targets = variants[0]
        recipe = space.recipe(method)  # (the same for each precision; SearchSpace.__post_init__ made it once: it does not raise)
        for precision in _precisions(gpu, space):
            knobs: list[_Knobs] = []
            for optimizer, sharding in itertools.product(space.optimizers, shardings):
                try:  # the row's first valid construction, copied with each other optimizer and sharding
                    if knobs:
                        config = knobs[0].config.taken_knobs(optimizer=optimizer, sharding=sharding)
                        if config is None:
                            continue  # (refused by the scheme, without raising: ``ShardingSpec.refusal``)
                    else:
                        config = TrainConfig(
                            method=method, precision=precision, optimizer=optimizer, micro_batch=per_device,
                            seq_len=seq_len, grad_accum=1, gpus=gpus, grad_ckpt=False, lora_r=r,
                            lora_targets=targets, sharding=sharding, **recipe)
                except PlannerError:
                    continue  # the combination is invalid whatever the adapters, split and checkpointing
                knobs.append(_Knobs(config, family_key(config), _static_key(config)[:-_STATIC_TAIL],
                                    _batch_key(config)[:-_BATCH_TAIL]))
            rows.append(_Row(variants, knobs))
    return rows


def _combinations(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int,
                  space: SearchSpace) -> Iterator[tuple[TrainConfig, list[tuple[int, int]]]]:
    """Each valid combination of the space's knobs but the split (a validated ``TrainConfig``
    with the whole per-device batch as its micro-batch), with every (micro, accumulation) split
    of the per-device batch in ascending micro-batch order: per method and precision (``_rows``),
    per adapter variant, per optimizer and sharding, without then with checkpointing.
    (``_screen`` walks the same order over the rows.)"""
    splits = _per_device_splits(target_batch, gpus)
    per_device = splits[-1][0]
    for row in _rows(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space):
        for n, lora in enumerate(row.variants):
            for knobs in row.knobs:
                base = knobs.variant(lora, n == 0)
                yield base, splits
                yield base.with_split(micro_batch=per_device, grad_accum=1, grad_ckpt=True), splits


# ---- the fast path: memoised terms and affine phase lines --------------------------------------
#: What the memo keys read of a configuration as it is, by the request's declaration
#: (``planner.request.memo_fields``): a field a memory term reads is declared there with its key.
_STATIC_FIELDS = attrgetter(*request.memo_fields(request.STATIC))
_BATCH_FIELDS = attrgetter(*request.memo_fields(request.BATCH))
#: How many fields each key ends with that ``_Knobs``' prefixes leave out (``planner.request.MEMO_TAIL``): the
#: adapter's rank and targets, then (the batch key's) checkpointing, which the screen appends to a prefix to make
#: a combination's keys (tests/search/test_search_screen.py holds them equal to ``_static_key``'s and ``_batch_key``'s).
_STATIC_TAIL = sum(name in request.memo_fields(request.STATIC) for name in request.MEMO_TAIL)
_BATCH_TAIL = sum(name in request.memo_fields(request.BATCH) for name in request.MEMO_TAIL)


def _static_key(config: TrainConfig) -> tuple:
    """What the batch-independent terms (``states.static_terms``) read of a configuration, and
    nothing more, so configurations they predict alike share them: the fields declared ``STATIC``
    and, of the precision, a stored weight's bytes (unquantised weights and full fine-tuning's
    trainable tensors; QLoRA's are NF4 and fp32 whatever the precision) and, under DeepSpeed,
    whether it is mixed (its 16-bit communication dtype, ``planner.sharding.zero.comm_bytes``); of
    the sharding, the one whose terms are equal on this many GPUs (``Sharding.memory_key``: ZeRO-2
    on one GPU partitions gradients over one rank, as ZeRO-1 does). The adapter fields come last
    (``_Knobs.static_prefix``). (tests/search/test_search_screen.py checks that configurations of one key
    have equal terms; tests/cli/test_request_fields.py that configurations predicted apart have apart keys.)"""
    sharding = config.sharding
    casts = sharding.spec.casts_model
    return (None if config.method is _QLORA else mode_of(config).weight,
            config.precision.is_mixed if casts else None, sharding.memory_key(config.gpus), *_STATIC_FIELDS(config))


def _batch_key(config: TrainConfig) -> tuple:
    """What the per-micro-batch terms depend on: the fields declared ``BATCH``, and the method,
    precision and sharding only as the terms read them (``memory.step.line_reads``: the dtype mode,
    as bf16 and fp16 autocast type every tensor alike, so do pure bf16 and DeepSpeed's 16-bit model;
    QLoRA as LoRA where its terms are LoRA's; whether the head saves its input, as ZeRO-3's frozen
    head does). The adapter fields and checkpointing come last (``_Knobs.batch_prefix``)."""
    return (*line_reads(config), *_BATCH_FIELDS(config))


class _Static(NamedTuple):
    """One static key's terms, as the screen reads them."""

    terms: StaticTerms
    parts: tuple[tuple[int, ...], tuple[int, ...]]
    """Per accumulating (False, True): the resident states plus each moment's static part."""
    resident: int
    """``terms.resident_bytes``."""
    fixed: int
    """What the screen's reserve adds to any peak besides fragmentation (``reserve.peak_independent``)."""
    ceilings: dict[int, int]
    """The largest peak that fits, by usable bytes (``reserve.largest_peak``), filled as ``_fit_and_miss`` screens."""
    screens_as: tuple
    """What the screen reads of these terms (parts, resident, fixed, host), one object per value in
    its memo: configurations whose terms are equal (a ZeRO stage that changes nothing on one GPU)
    screen alike, and the screen tells them by identity."""

    def total(self, peak: int, caching: bool) -> int:
        """The screen's process total of an allocated peak (the peak itself without a caching allocator)."""
        return process_total(peak, static=self.resident, fixed=self.fixed) if caching else peak


#: ``_Static(...)`` by position without its generated ``__new__`` (``_speed``'s note)
_new_static = tuple.__new__


@dataclass(frozen=True)
class _SharedTerms:
    """The device-free memoised terms of one model, for the searches of several devices."""

    model: ModelSpec
    tables: dict = dataclasses.field(default_factory=dict)
    """Kernel profile -> (trained, device-free static terms, batch lines, values) of MemoryMemo."""
    speeds: dict = dataclasses.field(default_factory=dict)
    """id of a GPUSpec -> (the GPUSpec, its ThroughputMemo), for the searches of its other GPU counts."""
    rows: dict = dataclasses.field(default_factory=dict)
    """What ``_rows`` reads of a search -> its rows, for the searches of other devices (``_shared_rows``)."""
    screens: dict = dataclasses.field(default_factory=dict)
    """The screen's tables (``_screen_tables``), for the searches whose terms and budgets are alike."""
    timelines: dict = dataclasses.field(default_factory=dict)
    """(configuration, kernel profile) -> its ``step_timeline``, and (configuration, kernel profile,
    cuBLAS workspace bytes) -> its ``_Estimated``: for the full estimates (``shared_estimate``)."""


_SHARED_TERMS: ContextVar["_SharedTerms | None"] = ContextVar("planner_shared_terms", default=None)


@contextmanager
def shared_terms(model: ModelSpec) -> Iterator[None]:
    """Within this block, every search of ``model`` shares its device-free terms (what each adapter
    set trains, the model states but for the device's fixed overheads, the per-sequence
    activations) with the other searches of devices whose kernels allocate alike: they depend on
    the model, the configuration and ``GPUSpec.kernels`` only (``static_terms``, ``batch_line``);
    and each device's throughput memo with its searches at other GPU counts (``_throughput_memo``);
    the full estimates of the plans shown share their timelines and allocator replays
    (``shared_estimate``).
    ``planner.rent`` plans one request on every GPU type this way: measured on Llama-3.1-8B at
    target batch 32 over 22 GPU types x 4 counts, the static terms were 23% and the batch lines
    10% of the CPU time when each search computed its own. Leaving the block drops the tables, so
    nothing outlives the model."""
    token = _SHARED_TERMS.set(_SharedTerms(model))
    try:
        yield
    finally:
        _SHARED_TERMS.reset(token)


@dataclass
class _Estimated:
    """What the full estimates of one configuration on one kind of device share (``shared_estimate``)."""

    timeline: Timeline
    """Its ``device_timeline``."""
    replayed: Replay | None = None
    """A replay of it, to reuse if none of its room checks failed (``clean``)."""
    capacity: int = 0
    """The capacity ``replayed`` was made on."""
    clean: bool | None = None
    """Whether no room check of ``replayed`` failed, once asked (``_largest_ask``: asked only when
    another device could reuse it, as the scan costs a thirtieth of a replay)."""


def _largest_ask(timeline: Timeline) -> int:
    """An upper bound on the bytes one room check of the allocator replay asks for: a new segment
    (``allocation_size`` of its request) or expandable pages (the request rounded up to a page, at
    most kLargeBuffer: CachingAllocator ``_new_segment``, ``_expand``), for the largest tensor of
    the timeline (an event's tensors: their sizes, or ``nbytes`` in equal parts whose last takes
    the remainder, as ``CachingAllocator.malloc_tensors`` divides it)."""
    largest = 0
    for op, _, nbytes, tensors, _, _ in timeline.events:
        if op == "alloc":
            tensor = max(tensors) if type(tensors) is tuple else nbytes - nbytes // tensors * (tensors - 1)
            largest = max(largest, tensor)
    return allocation_size(largest) + kLargeBuffer


def shared_estimate(*, model: ModelSpec, config: TrainConfig, gpu: GPUSpec, budget: int,
                    dropping: bool = False, memo: MemoryMemo | None = None,
                    totals: bool = False) -> MemoryEstimate | ReplayedTotals | None:
    """``estimate_memory`` of ``config`` on ``gpu`` within ``budget``; inside ``shared_terms``, with
    what other devices' estimates computed. The plans shown of a ``--gpu any`` comparison are few
    configurations on many devices: on Llama-3.1-8B at target batch 32, 256 full estimates of 138
    (configuration, kernels) pairs over 24 GPU types.

    - The step's timeline reads the model, the configuration and ``gpu.kernels`` only
      (``step_timeline``'s arguments); with the cuBLAS workspaces, the compute capability besides
      (``device_timeline``).
    - A replay in which no room check failed is the replay on any capacity at or above its peak
      reserve (planner/memory/allocator.py). The capacity enters the replay only as the
      allocator's room: in the checks that a new segment, expandable pages or a run of fresh
      segments fit (``_new_segment``, ``_expand``, ``_fresh``, whose shortfall is followed by a
      ``_new_segment`` that fails), each of which, passed, makes the reserve it checked (at most
      the peak, ``Replay.peak_reserved``, which is at least either stream's own); the cache is
      released only after one failed; and as the base address of the small pool's expandable
      segment, which moves every small-pool address alike (blocks are ordered and joined within
      a pool only). A check fails only where the reserve so far plus what it asks exceeds the
      capacity, so a replay whose peak reserve plus the most one check asks (``_largest_ask``)
      fits its capacity had none fail.

    ``dropping``: None where the allocator runs out of memory within ``budget`` (its process total
    would be over it: ``replay(measure=False)``), for a caller that drops such a plan and reads
    nothing else of it (``planner.ranking``): neither the replay without the limit that would say
    by how much nor the rest of the estimate is made, and inside ``sharing_prefixes`` its timeline
    stops where an earlier replay of the same first events ran out (``known_to_run_out``). Llama-2-7B on an A10G: 9 of a search's 17
    full estimates are such plans (QLoRA at micro-batch 8, whose replay reserves about 6.6 GiB
    over its allocated peak).

    ``memo``: the search's, of this model and device, whose timelines share their activations
    (``MemoryMemo.activations``). ``totals``: its process total and paged states first
    (``estimate.ReplayedTotals``), the rest of the estimate (breakdown, peak phase, assumptions)
    made when asked: the ranking reads the totals alone of the plans its replays drop or find
    near the edge (Llama-3.1-8B on 8 RTX 3090s: 58 of the 59 full estimates of ``--gpu any``'s search)."""
    kernels = gpu.kernels
    activations = memo.activations if memo is not None and memo.model is model and memo.kernels is kernels else None
    # a plan dropped where its replay runs out: its timeline's making stops where the replays made have
    # run out in its first events (``known_to_run_out``); its replay would have said None there
    abandon = known_to_run_out(config, gpu, budget) if dropping else None
    made = _device_timeline(model, config, gpu, abandon, activations)
    if made is None:
        return None
    timeline, found = made
    replayed = None
    if kernels.caching_allocator:
        replayed = _replayed(timeline, found, config, gpu, budget, dropping)
        if replayed is None:
            return None
    made = ReplayedTotals(model, config, gpu, timeline, replayed)
    return made if totals else made.estimate()


def _device_timeline(model: ModelSpec, config: TrainConfig, gpu: GPUSpec, abandon,
                     activations: dict | None) -> tuple[Timeline, _Estimated | None] | None:
    """(``device_timeline`` of ``config`` on ``gpu``, what the estimates of other devices share of it:
    inside ``shared_terms``, else None), or None where ``abandon`` stopped its step's timeline
    (``shared_estimate``)."""
    shared, kernels = _SHARED_TERMS.get(), gpu.kernels
    if shared is not None and shared.model is not model:
        shared = None
    step = None
    if shared is not None:
        key = (config, kernels, cublas_workspace_bytes(gpu))
        found = shared.timelines.get(key)
        if found is not None:
            return found.timeline, found
        step = shared.timelines.get((config, kernels))
    if step is None:
        step = step_timeline(model=model, config=config, kernels=kernels, abandon=abandon, shared=activations)
        if step is None:
            return None
        if shared is not None:
            shared.timelines[config, kernels] = step
    timeline = device_timeline(model=model, config=config, gpu=gpu, step=step)
    if shared is None:
        return timeline, None
    found = shared.timelines[key] = _Estimated(timeline)
    return timeline, found


def _replayed(timeline: Timeline, found: _Estimated | None, config: TrainConfig, gpu: GPUSpec, budget: int,
              dropping: bool) -> Replay | None:
    """The allocator replay of ``timeline`` within ``budget``: ``found``'s, where another device's
    replay had no room check fail and fits this capacity (``shared_estimate``), else made (and kept
    in ``found`` for the next device); None where ``dropping`` and it runs out."""
    capacity, made = replay_capacity(timeline, config, gpu, budget), found.replayed if found is not None else None
    if made is not None and made.peak_reserved <= capacity and found.clean is None:
        found.clean = made.peak_reserved + _largest_ask(timeline) <= found.capacity
    if made is not None and made.peak_reserved <= capacity and found.clean:
        return made
    replayed = replay_timeline(timeline, config, gpu, budget=budget, measure=not dropping)
    if replayed is not None and found is not None and (made is None or found.clean is False):
        found.replayed, found.capacity, found.clean = replayed, capacity, None
    return replayed


class MemoryMemo:
    """The memory model's terms for one model on one device, memoised for one search: thousands
    of candidates share what they train (per adapter set), their model states (per static key)
    and their per-sequence activations (per batch key). Lives as long as the search that made it,
    so it never outlives its model; inside ``shared_terms`` the device-free tables are those of
    every search of the model on devices of the same kernels."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec) -> None:
        self.model, self.gpu, self.kernels = model, gpu, gpu.kernels
        self.caching = gpu.kernels.caching_allocator
        shared = _SHARED_TERMS.get()
        tables = (shared.tables.setdefault(gpu.kernels, ({}, {}, {}, {}, {})) if shared is not None and shared.model is model
                  else ({}, {}, {}, {}, {}))
        self._trained: dict[tuple, tuple[Trained, tuple[int, int]]] = tables[0]
        #: per static key, the terms that do not depend on the device (``_device_free``)
        self._free: dict[tuple, tuple] = tables[1]
        self._batch: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = tables[2]
        # one object per value of the static terms' screened part and of a batch line
        # (``_Static.screens_as``, ``batch_line``): the screen keys its results by their identity
        self._values: dict[tuple, tuple] = tables[3]
        self._static: dict[tuple, _Static] = {}
        #: (paged bytes the step needs on the device, GPU count) -> ``peak_independent``: what it reads
        #: besides the model and device
        self._fixed: dict[tuple[int, int], int] = {}
        #: the full estimates' timelines' activations (``step_timeline``'s ``shared``)
        self.activations: dict[tuple, object] = tables[4]
        #: the screen's speeds (``_screen``), for the ranking's bound on what its rounds can add
        #: (``planner.ranking._Settling._bound``): (method, precision) -> (the row's speeds by (knob class, adapter
        #: variant, checkpointing, split index, paged bytes), the variant's index by (lora_r, lora_targets), the knob
        #: class the screen took by (optimizer, sharding)), and each split's index by its micro-batch
        self.speeds_at: dict[tuple, tuple[dict, dict, dict]] = {}
        self.split_index: dict[int, int] = {}

    def _adapters(self, config: TrainConfig) -> tuple[Trained, tuple[int, int]]:
        """What ``config`` trains and its first block's trainable elements (``first_block_params``):
        both depend on the adapter set only."""
        key = (config.method.uses_adapters, config.lora_r, config.lora_targets)
        found = self._trained.get(key)
        if found is None:
            t = trained(self.model, config)
            found = self._trained[key] = (t, first_block_params(self.model, config, t))
        return found

    def trained(self, config: TrainConfig) -> Trained:
        return self._adapters(config)[0]

    def static(self, config: TrainConfig, key: tuple | None = None) -> _Static:
        """The static terms and, per accumulating (False, True), the resident states plus each
        moment's static part. ``key``: ``config``'s ``_static_key``, where the caller has it (the
        screen makes it from its knobs' prefix: working it out again was 1% of a search)."""
        key = key or _static_key(config)
        found = self._static.get(key)
        if found is None:
            found = self._static[key] = self._static_terms(config, key)
        return found

    def _device_free(self, config: TrainConfig, key: tuple) -> tuple[StaticTerms, tuple, int]:
        """(static terms, each accumulating's resident states plus moment parts, resident bytes):
        what the model, the configuration and the kernels decide, shared under ``shared_terms``."""
        found = self._free.get(key)
        if found is None:
            t, params = self._adapters(config)
            static = static_terms(self.model, config, self.kernels, t)
            resident = static.resident_bytes
            head_grads, down_grads = first_block_gradients(self.model, config, static.gradients, t, params)
            parts = static_parts(static, resident, head_grads, down_grads)
            # one object per value, as the screen's peaks are kept by its identity (``_peaks``): 489 static
            # keys of an every-precision search of the bench request hold 435 values
            found = self._free[key] = (static, self._values.setdefault(parts, parts), resident)
        return found

    def _static_terms(self, config: TrainConfig, key: tuple) -> _Static:
        """``config``'s static terms on this device (``key``: its ``_static_key``)."""
        static, parts, resident = self._device_free(config, key)
        # the paged states the process total holds: the stepped tensor's, as estimate_memory's
        # (``Timeline.outside_allocator``)
        fixed = self._fixed.get((static.paged_step, config.gpus))
        if fixed is None:
            fixed = self._fixed[static.paged_step, config.gpus] = peak_independent(
                self.model, self.gpu, paged=static.paged_step, gpus=config.gpus)
        value = (parts, resident, fixed, static.host)
        # (by position, without the named tuple's Python ``__new__``: ``_speed``'s note, 489 a search)
        return _new_static(_Static, (static, parts, resident, fixed, {}, self._values.setdefault(value, value)))

    def batch_line(self, config: TrainConfig, key: tuple | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each moment's per-micro-batch part at b = 1 and its increase per sample (every term is
        affine in the micro-batch); shared by every optimizer and ZeRO stage of the same method,
        precision and shape, and one object per value (``_screen``). ``key``: ``config``'s
        ``_batch_key``, where the caller has it."""
        key = key or _batch_key(config)
        found = self._batch.get(key)
        if found is None:
            line = batch_line(self.model, config, self.kernels, self.trained(config).target_names)
            found = self._batch[key] = self._values.setdefault(line, line)
        return found

    def batch_lines(self, config: TrainConfig, key: tuple, ckpt_key: tuple) -> tuple[tuple, tuple]:
        """(``batch_line`` of ``config``, which does not checkpoint, of it with checkpointing), keys
        ``key`` and ``ckpt_key``: where the memo has neither, both in one pass (``step.batch_line_pair``:
        they share every later block's terms)."""
        without, with_ckpt = self._batch.get(key), self._batch.get(ckpt_key)
        if without is None and with_ckpt is None:
            lines = batch_line_pair(self.model, config, self.kernels, self.trained(config).target_names)
            without = self._batch[key] = self._values.setdefault(lines[0], lines[0])
            with_ckpt = self._batch[ckpt_key] = self._values.setdefault(lines[1], lines[1])
        elif without is None:
            without = self.batch_line(config, key)
        elif with_ckpt is None:
            ckpt = config.with_split(micro_batch=config.micro_batch, grad_accum=config.grad_accum, grad_ckpt=True)
            with_ckpt = self.batch_line(ckpt, ckpt_key)
        return without, with_ckpt

    def split_total(self, config: TrainConfig):
        """(total(micro, accumulation), host bytes) of ``config``: its process total at any split,
        exactly as ``estimate_memory``'s screen computes it. Each moment of
        ``planner.memory.step.MOMENTS`` is a sum of static parts and per-micro-batch parts, the
        latter affine in the micro-batch (``static_moments``, ``batch_moments``), so a split costs
        seven multiply-adds, the largest, and the reserve on top."""
        static = self.static(config)
        one, slope = self.batch_line(config)
        caching = self.caching

        def total(micro: int, accum: int) -> int:
            return static.total(_peak(static.parts[accum > 1], one, slope, micro), caching)

        return total, static.terms.host

    def fit_and_miss(self, config: TrainConfig, splits, *, usable: int, cpu_mem: int):
        """``_fit_and_miss`` of ``config``'s terms."""
        return _fit_and_miss(self.static(config), _line_at(self.batch_line(config), splits), usable, cpu_mem,
                             self.caching)


def _peak(parts: tuple[int, ...], one: tuple[int, ...], slope: tuple[int, ...], micro: int) -> int:
    """The largest moment at this micro-batch (the allocated peak): each moment's static part,
    its per-micro-batch part at b = 1, and its slope times the samples beyond the first."""
    k = micro - 1
    return max([p + o + s * k for p, o, s in zip(parts, one, slope)])


def _line_at(line: tuple[tuple[int, ...], tuple[int, ...]], splits) -> list[tuple[int, ...]]:
    """Each moment's per-micro-batch part at each split's micro-batch: ``_peak`` less the static
    part, which the screen then adds moment by moment (a batch line meets several static terms)."""
    one, slope = line
    # (mapped: the comprehension's frame and per-element bytecode were most of its cost; at micro-batch 1 the
    # part is ``one`` and at 2 ``one + slope``, without the products: the screen's bytes are multi-digit ints)
    return [one if micro == 1 else tuple(map(add, one, slope)) if micro == 2
            else tuple(map(add, one, map(mul, slope, repeat(micro - 1)))) for micro, _ in splits]


def _line_at_once(at_of: dict, line: tuple[tuple[int, ...], tuple[int, ...]], splits) -> list[tuple[int, ...]]:
    """``_line_at`` of ``line``, once per line of one screen (``at_of``: by the line's id). The memo
    hands out one object per line value (``MemoryMemo.batch_line``) and keeps it for the search, so
    its id names its value: the 156 batch lines of an every-precision search of the bench request
    (78 slots, without and with checkpointing) hold 118 values, which its keys find without working
    out the other 38 (``step.line_reads``), and other requests' keys may still hold equal values. One
    list per value also lets the peaks table (``_peaks``, by the id of the list) serve every slot of
    that value."""
    found = at_of.get(id(line))
    if found is None:
        found = at_of[id(line)] = _line_at(line, splits)
    return found


def totals_by_split(*, model: ModelSpec, config: TrainConfig, gpu: GPUSpec, splits,
                    memo: MemoryMemo | None = None) -> list[tuple[int, int]]:
    """(process_total_bytes, cpu_bytes) of ``config`` with each (micro_batch, grad_accum) of
    ``splits`` instead of its own, exactly as ``estimate_memory`` computes them: the search's
    inner loop (``MemoryMemo.split_total``)."""
    memo = memo or MemoryMemo(model, gpu)
    total, host = memo.split_total(config)
    return [(total(micro, accum), host) for micro, accum in splits]


def family_label(config: TrainConfig) -> str:
    return f"{config.method}, {config.precision}, {config.optimizer}"


def family_key(config: TrainConfig) -> tuple:
    """What ``family_label`` words, as a key (formatting the string costs more than the search needs)."""
    return (config.method, config.precision, config.optimizer)


def check_request(*, model: ModelSpec, target_batch: int, seq_len: int, gpus: int, top_k: int,
                  space: SearchSpace | None = None) -> None:
    if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
        raise InvalidConfigError(f"--target-batch must be a whole number >= 1, got {target_batch!r}")
    if target_batch > MAX_TARGET_BATCH:
        raise InvalidConfigError(
            f"--target-batch {target_batch} is more than {MAX_TARGET_BATCH:,} sequences per optimizer step: "
            "give the global batch in sequences, e.g. 32"
        )
    check_gpu_count(gpus)
    # estimate's wording (estimation.build_config, TrainConfig): one line per mistake on every command
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise InvalidConfigError(f"--seq-len must be a whole number >= 1, got {seq_len!r}")
    check_context(model, seq_len, space)  # the model's context, with the space's RoPE scaling
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InvalidConfigError(f"--top-k must be a whole number >= 1, got {top_k!r}")


def _screen(rows: list[_Row], splits: list[tuple[int, int]], *, model: ModelSpec, gpu: GPUSpec, memo: MemoryMemo,
            usable: int, cpu_mem: int, speeds: ThroughputMemo | None = None, gpus: int = 1):
    """(fitting [(config, speed, total, static terms)], each family's closest miss {family: (total, config)},
    candidates searched) of every combination of ``_combinations``, in its order, with the fast
    path's totals: each combination's largest fitting split, then, in the same order, the largest
    split that is not near the edge (``safe_bound``) of each fit that is, where one exists
    (``_largest_under``: the plan an expert runs, with room for the model's measured error). A combination is made (``_Knobs.variant``) only when the memo has not its terms
    yet or it fits or comes closest: its knobs' prefixes and adapter variant find its terms in
    tables that hand out what the memo did (``static_slot``, ``line_slot``). Combinations whose
    terms are equal (a bf16 plan and its fp16 twin, one dtype mode; a ZeRO stage that changes
    nothing on one GPU) share one screening: the memo hands out one object per value
    (``_Static.screens_as``, ``batch_line``)."""
    # (config, speed, total, static) of each largest fit, and of each near-the-edge fit's safe split:
    # each timed as it is found (``_timed``), not copied into a list of its own first
    largest_fit: list[tuple] = []
    safe_splits: list[tuple] = []
    speeds = speeds or _throughput_memo(model, gpu)
    closest: dict[tuple, tuple] = {}  # family -> (total, knobs, adapter variant, its index, split index, ckpt)
    bounds = {method: safe_bound(method, gpu, gpus) for method in Method}
    searched, caching = 0, memo.caching
    statics, lines, peaks, screened, safer = _screen_tables(rows, memo, usable, cpu_mem)
    made = _made_configs(rows)
    at_of: dict[int, list[tuple[int, ...]]] = {}  # id of a batch line -> its value at each split (``_line_at_once``)
    # each knob class (``ThroughputMemo.knob_class``; on the CPU profile, each knobs its own) as a small int: the
    # speeds' keys hash it once a fitting plan, and a class is a tuple of floats and a tuple
    classes: dict[object, int] = {}
    memo.split_index.update((micro, i) for i, (micro, _) in enumerate(splits))
    for row in rows:
        n = len(row.variants)
        searched += 2 * len(splits) * n * len(row.knobs)  # (without and with checkpointing, at every split)
        # each knobs' slots of its prefixes, and its method's safe bound (one search, one device)
        slots = [(knobs, statics.setdefault(knobs.static_prefix, [None] * n),
                  lines.setdefault(knobs.batch_prefix, [None] * n), bounds[knobs.config.method],
                  classes.setdefault(speeds.knob_class(knobs.config) or id(knobs), len(classes))) for knobs in row.knobs]
        # the row's speeds by (knob class, adapter variant, checkpointing, split, paged host bytes): the knobs
        # of one row differ in optimizer and sharding only, which the class says all the step time reads of
        timed: dict[tuple, Speed] = {}
        if slots:  # (kept for the ranking: ``MemoryMemo.speeds_at``)
            config = row.knobs[0].config
            memo.speeds_at[config.method, config.precision] = (
                timed, {lora: v for v, lora in enumerate(row.variants)},
                {(knobs.config.optimizer, knobs.config.sharding): timing for knobs, *_, timing in slots})
        for v, lora in enumerate(row.variants):
            first = v == 0
            for knobs, static_slot, line_slot, bound, timing in slots:
                base = None
                static = static_slot[v]
                if static is None:  # (the keys: the knobs' prefixes and the variant's adapter fields)
                    base = knobs.variant(lora, first)
                    static = static_slot[v] = memo.static(base, knobs.static_prefix + lora)
                pair = line_slot[v]
                if pair is None:
                    base = base or knobs.variant(lora, first)
                    both = memo.batch_lines(base, knobs.batch_prefix + lora + (False,),
                                            knobs.batch_prefix + lora + (True,))
                    pair = line_slot[v] = tuple((_line_at_once(at_of, line, splits), id(line)) for line in both)
                static_id = id(static.screens_as)
                for ckpt, (at, line_id) in enumerate(pair):
                    found = screened.get((static_id, line_id))
                    if found is None:
                        found = screened[static_id, line_id] = _fit_and_miss(
                            static, at, usable, cpu_mem, caching, _peaks(peaks, static, at))
                    fit, miss = found
                    if miss is not None:
                        closer = closest.get(knobs.family)
                        if closer is None or miss[0] < closer[0]:
                            # (made at the end)
                            closest[knobs.family] = (miss[0], knobs, lora, v, miss[1], ckpt)
                    if fit is not None:
                        config = made.get((id(knobs), v, fit[1], ckpt)) if made is not None else None
                        if config is None:
                            base = base or knobs.variant(lora, first)
                            micro, accum = splits[fit[1]]
                            config = base.with_split(micro_batch=micro, grad_accum=accum, grad_ckpt=ckpt == 1)
                            if made is not None:
                                made[id(knobs), v, fit[1], ckpt] = config
                        if fit[0] <= bound:
                            largest_fit.append(_timed(config, fit[0], static, speeds, timed, (timing, v, ckpt, fit[1])))
                        else:  # near the edge: timed when the ranking reaches it (``timed``)
                            largest_fit.append((config, None, fit[0], static))
                        if fit[0] > bound and fit[1]:  # near the edge, with a smaller micro-batch to try
                            key = (static_id, line_id, bound)
                            safe = safer.get(key, ())
                            if safe == ():
                                safe = safer[key] = _largest_under(static, at, fit[1], bound, caching,
                                                                   _peaks(peaks, static, at))
                            if safe is not None:
                                smaller = made.get((id(knobs), v, safe[1], ckpt)) if made is not None else None
                                if smaller is None:
                                    micro, accum = splits[safe[1]]
                                    smaller = config.with_split(micro_batch=micro, grad_accum=accum)
                                    if made is not None:
                                        made[id(knobs), v, safe[1], ckpt] = smaller
                                safe_splits.append(_timed(smaller, safe[0], static, speeds, timed,
                                                          (timing, v, ckpt, safe[1])))
    misses = {}
    for total, knobs, lora, v, split, ckpt in closest.values():
        micro, accum = splits[split]
        config = knobs.variant(lora, v == 0).with_split(micro_batch=micro, grad_accum=accum, grad_ckpt=ckpt == 1)
        misses[family_label(config)] = (total, config)
    return largest_fit + safe_splits, misses, searched


def _screen_tables(rows: list[_Row], memo: MemoryMemo, usable: int,
                   cpu_mem: int) -> tuple[dict, dict, dict, dict, dict]:
    """The screen's tables: per static prefix, each adapter variant's static terms; per batch
    prefix, each variant's batch lines (without, with checkpointing), each with its value at every
    split and its id; the peaks of a pair of static parts and batch line at each split (``_peaks``);
    the screenings of a pair of
    terms by their identities (``_fit_and_miss``), and of a near-the-edge fit's safe split
    (``_largest_under``, by bound too). Fresh for one search. Inside ``shared_terms``, a search of
    the same rows (``_shared_rows``: the same space, batch, sequence length and GPU count) on a
    device whose kernels allocate alike takes the batch lines and the peaks, and where the device
    adds the same fixed bytes the static terms (``reserve.peak_independent`` is the device's part
    plus the paged states: equal without paged states is equal with any), and where the budgets
    (usable bytes, host RAM per rank) are equal too the screenings: the rest of what it screens
    was decided by the same numbers. ``--gpu any`` on Llama-3.1-8B at target batch 32 plans 96
    searches on 23 GPU types and four GPU counts, whose devices add one of three fixed parts at one GPU."""
    shared = _SHARED_TERMS.get()
    gpus = next((knobs.config.gpus for row in rows for knobs in row.knobs), None)
    if shared is None or shared.model is not memo.model or gpus is None:
        return {}, {}, {}, {}, {}
    fixed = peak_independent(memo.model, memo.gpu, paged=0, gpus=gpus)
    keys = (("static", id(rows), memo.kernels, fixed), ("lines", id(rows), memo.kernels),
            ("screened", id(rows), memo.kernels, fixed, usable, cpu_mem))
    tables = []
    for key in keys:
        found = shared.screens.get(key)
        if found is None or found[0] is not rows:  # (the rows are kept, so their id is not reused)
            found = shared.screens[key] = (rows, {}, {})
        tables.append(found)
    return tables[0][1], tables[1][1], tables[1][2], tables[2][1], tables[2][2]


def _made_configs(rows: list[_Row]) -> dict | None:
    """Inside ``shared_terms``, the configurations the searches of ``rows`` (``_shared_rows``) have
    made of a combination at a split, by (id of its ``_Knobs``, adapter variant, split index,
    checkpointing), for the searches of other devices: the same plan needs no copy (a ``--gpu any``
    comparison of Llama-3.1-8B on 8 GPU types ran 1.2% fewer instructions, valgrind). A search makes each key once,
    so its plans are still distinct objects (the ranking tells them by identity). None outside."""
    shared = _SHARED_TERMS.get()
    if shared is None:
        return None
    found = shared.screens.get(("configs", id(rows)))
    if found is None or found[0] is not rows:  # (the rows are kept, so their id is not reused)
        found = shared.screens["configs", id(rows)] = (rows, {})
    return found[1]


def _peaks(table: dict, static: _Static, at: list[tuple[int, ...]]) -> list[int | None]:
    """The allocated peak at each split of ``static``'s parts with the batch line at ``at``
    (``_line_at``; the last split's without accumulation), filled in as the screen evaluates them
    (None: not yet), from ``table`` (``_screen_tables``): the parts and the line do not depend on the
    device, only which peak fits does, so a ``--gpu any`` comparison's devices bisect on peaks the
    first evaluated."""
    key = (id(static.parts), id(at))
    found = table.get(key)
    if found is None:
        found = table[key] = [None] * len(at)
    return found


def _shared_rows(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int,
                 space: SearchSpace) -> list[_Row]:
    """``_rows``; inside ``shared_terms``, those of an earlier search that read the same: of the
    device, its precisions and whether it is the cpu profile; of the space, all but the node's
    RAM (each device's node has its own)."""
    shared = _SHARED_TERMS.get()
    if shared is None or shared.model is not model:
        return _rows(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space)
    key = (_precisions(gpu, space), gpu.is_cpu, target_batch, seq_len, gpus,
           dataclasses.replace(space, cpu_mem_bytes=0, host_ram_source=""))
    found = shared.rows.get(key)
    if found is None:
        found = shared.rows[key] = _rows(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus,
                                         space=space)
    return found


def _timed(config: TrainConfig, total: int, static: _Static, speeds: ThroughputMemo, timed: dict,
           slot: tuple) -> tuple:
    """(config, speed, total, static terms) of a fitting plan: ranking needs the speed only; the full
    estimate (with its assumptions) is made for the plans shown. A plan whose paged optimizer
    states the device has no room for is timed with their paging (``paged_host``). ``timed``: the
    speeds of the screen's row by ``slot`` (the knobs' class, ``ThroughputMemo.knob_class``, adapter
    variant, checkpointing and split index) and paged bytes: the plans of one slot take one speed."""
    paging = paged_host(static.terms, total, speeds.gpu) if static.terms.paged else 0
    key = (*slot, paging)
    speed = timed.get(key)
    if speed is None:
        speed = timed[key] = _speed(Speed, (tokens_per_second(config, speeds.step_seconds(config, paging)),))
    return config, speed, total, static


def timed(item: tuple, speeds: ThroughputMemo) -> tuple:
    """A fitting plan the screen left untimed (its speed None: ``Screened.fitting``), timed as the
    screen times the others (``_timed``: the same float, ``ThroughputMemo.knob_class``)."""
    config, _, total, static = item
    return _timed(config, total, static, speeds, {}, ())


#: ``Speed``'s constructor without its generated ``__new__`` (a Python-level lambda): the screen
#: makes one per fitting plan, about 2,000 a search (Llama-2-7B on an A10G, every precision)
_speed = tuple.__new__


def paged_host(terms: StaticTerms, total: int, gpu: GPUSpec) -> int:
    """``MemoryEstimate.paged_host_bytes`` of a plan of these static terms whose process total the
    screen puts at ``total`` (which holds ``terms.paged_step``, as the full estimate's does)."""
    if not terms.paged:
        return 0
    return paged_on_host(terms.paged, required=terms.paged_step, device=gpu.memory_bytes, total=total)


def _throughput_memo(model: ModelSpec, gpu: GPUSpec) -> ThroughputMemo:
    """The throughput model's memo for this search; inside ``shared_terms``, one per device, which
    the searches of its other GPU counts share: a ``ThroughputMemo`` is for one model on one device,
    keyed on every field of the configuration it reads (its micro-step's work, at any micro-batch,
    was 4% of a ``--gpu any`` comparison, computed four times a device)."""
    shared = _SHARED_TERMS.get()
    if shared is None or shared.model is not model:
        return ThroughputMemo(model, gpu)
    found = shared.speeds.get(id(gpu))
    if found is None or found[0] is not gpu:  # (the GPUSpec is kept, so its id is not reused)
        found = shared.speeds[id(gpu)] = (gpu, ThroughputMemo(model, gpu))
    return found[1]


def _largest_under(static: _Static, at: list[tuple[int, ...]], below: int, bound: int,
                   caching: bool, peaks: list[int | None]) -> tuple[int, int] | None:
    """(total, index) of the largest split before ``below`` whose process total is at most
    ``bound``, or None: what scanning the splits from ``below`` - 1 down finds, by bisection, as
    ``_fit_and_miss`` finds the largest fit (the splits before a fit's all accumulate, and along
    them the peak never falls)."""
    accumulating = static.parts[1]
    ceiling = _ceiling(static, bound, caching)
    lo, _, lo_peak, _ = _boundary(accumulating, at, peaks, ceiling, -1, 0, below, 0)
    return (static.total(lo_peak, caching), lo) if lo >= 0 else None


def _boundary(accumulating: tuple[int, ...], at: list[tuple[int, ...]], peaks: list[int | None], ceiling: int,
              lo: int, lo_peak: int, hi: int, hi_peak: int) -> tuple[int, int, int, int]:
    """Bisection between split ``lo`` (fits, or -1) and split ``hi`` (misses), every split between
    them accumulating, along which the peak never falls: (lo, hi, lo_peak, hi_peak) with ``hi =
    lo + 1``, the last split whose peak is within ``ceiling`` and the first past it (``peaks``:
    ``_peaks``)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        peak = peaks[mid]
        if peak is None:
            peak = peaks[mid] = max(map(add, accumulating, at[mid]))
        if peak <= ceiling:
            lo, lo_peak = mid, peak
        else:
            hi, hi_peak = mid, peak
    return lo, hi, lo_peak, hi_peak


def _ceiling(static: _Static, bound: int, caching: bool) -> int:
    """The largest allocated peak whose process total is within ``bound`` bytes (``reserve.largest_peak``;
    the bound itself without a caching allocator), remembered per bound on the static terms."""
    ceiling = static.ceilings.get(bound)
    if ceiling is None:
        ceiling = static.ceilings[bound] = (largest_peak(bound, static=static.resident, fixed=static.fixed)
                                            if caching else bound)
    return ceiling


def _fit_and_miss(static: _Static, at: list[tuple[int, ...]], usable: int, cpu_mem: int, caching: bool,
                  peaks: list[int | None] | None = None) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """((total, index) of the largest fitting split, (total, index) of the smallest miss) of one
    combination (its static terms, and its batch line at each split: ``_line_at``), None where
    there is none; ties go to the first split, as a scan in order finds.

    What ``totals_by_split`` gives for every split, found with fewer evaluations: a split fits
    when its peak is at most the largest peak whose process total is usable
    (``reserve.largest_peak``), so only peaks are compared; every split but the last accumulates
    (micro < per-device batch), and along those the peak never falls as the micro-batch grows
    (each moment is affine in it with a slope >= 0), so the boundary between fitting and missing
    is found by bisection; the last split, without accumulation, is evaluated on its own. Host RAM
    does not depend on the split: over --cpu-mem, every split misses. ``peaks``: ``_peaks``, else
    none evaluated yet. (The screen runs this about 1,100 times a search, so its steps are written
    out: ``_boundary`` is called only with a split to bisect.)"""
    single, accumulating = static.parts
    ceiling = static.ceilings.get(usable)
    if ceiling is None:
        ceiling = _ceiling(static, usable, caching)
    last = len(at) - 1
    peaks = [None] * len(at) if peaks is None else peaks
    last_peak = peaks[last]
    if last_peak is None:
        last_peak = peaks[last] = max(map(add, single, at[last]))
    host_fits = static.terms.host <= cpu_mem
    # the accumulating splits 0..last-1: lo fits (or -1), hi misses (or last); the first is tried
    # first, as most combinations miss at every split (62% for the bench request)
    lo, hi, lo_peak, hi_peak = -1, last, 0, 0
    if last:
        peak = peaks[0]
        if peak is None:
            peak = peaks[0] = max(map(add, accumulating, at[0]))
        if peak > ceiling or not host_fits:
            hi, hi_peak = 0, peak
        else:
            lo, lo_peak = 0, peak
            if last > 1:
                lo, hi, lo_peak, hi_peak = _boundary(accumulating, at, peaks, ceiling, 0, peak, last, 0)
    if last_peak <= ceiling and host_fits:  # (accumulation can make a smaller micro-batch miss where it fits)
        return (static.total(last_peak, caching), last), (static.total(hi_peak, caching), hi) if hi < last else None
    fit = (static.total(lo_peak, caching), lo) if lo >= 0 else None
    # the smaller of the two misses, by peak: the process total grows strictly with it
    # (``reserve.largest_peak``), and a tie goes to the first split
    if hi < last and hi_peak <= last_peak:
        return fit, (static.total(hi_peak, caching), hi)
    return fit, (static.total(last_peak, caching), last)


class Screened(NamedTuple):
    """What ``screen`` found: the fitting plans and each family's closest miss, for the ranking."""

    fitting: list[tuple]
    """(config, speed, screened process total, its static terms) of each combination's largest
    fitting split, then of each near-the-edge one's largest safe split (``_screen``): the ranking
    reads the host bytes of the static terms (``planner.ranking._exotic``) without working out
    their key again. A largest fit near the edge (over ``safe_bound``) has no speed (None): the
    ranking reaches such plans only after every other (``planner.ranking._ranking``), and times
    them then (``timed``); 650 of the bench request's 1,662 plans (every precision), never reached."""
    closest: dict[str, tuple[int, TrainConfig]]
    """Each family's closest miss (``family_label``): (screened process total, config)."""
    searched: int
    """Candidates searched."""
    memo: "MemoryMemo"
    """The terms the screen computed, for what the ranking asks of them."""
    usable: int
    """Device memory less the safety margin: what a plan's process total must stay under."""
    margin: int
    """The safety margin (``safety_margin``)."""
    speeds: ThroughputMemo
    """The throughput model's memo the screen timed the plans with, for the plans the ranking adds."""


def skipped_precisions(gpu: GPUSpec, space: SearchSpace) -> list[str]:
    """The space's precisions the GPU cannot run, which ``screen`` warns of."""
    # fp8 is skipped without a word where the GPU has no FP8 (an accelerator asked alone is refused: _precisions)
    return [str(p) for p in space.precisions or () if p not in _precisions(gpu, space) and p is not Precision.FP8]


def screen(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int,
           space: SearchSpace) -> Screened:
    """Screen every combination of the space with the fast path (``_screen``), warning of the
    space's precisions the GPU cannot run."""
    skipped = skipped_precisions(gpu, space)
    if skipped:
        warnings.warn(f"{gpu.display_name} cannot run {', '.join(skipped)} (bf16 needs compute capability 8.0): "
                      "searching the space's other precisions", stacklevel=3)
    margin = safety_margin(gpu.memory_bytes)
    usable = gpu.memory_bytes - margin
    memo = MemoryMemo(model, gpu)
    splits = _per_device_splits(target_batch, gpus)
    rows = _shared_rows(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, space=space)
    # the screen compares each candidate's host bytes, one rank's, with one rank's share of the
    # node's RAM (SearchSpace.offload_budget); handed the number alone: a copy of the space would
    # validate its recipe again (TrainConfig constructions, 1% of a search)
    speeds = _throughput_memo(model, gpu)
    fitting, closest, searched = _screen(rows, splits, model=model, gpu=gpu, memo=memo, usable=usable,
                                         cpu_mem=space.offload_budget(gpus), speeds=speeds, gpus=gpus)
    return Screened(fitting, closest, searched, memo, usable, margin, speeds)


def plan_request(*, model: ModelSpec, gpu: GPUSpec, target_batch: int, seq_len: int, gpus: int, space: SearchSpace,
             top_k: int, model_fingerprint: str) -> PlanRequest:
    return PlanRequest(
        model_id=model.id,
        model_fingerprint=model_fingerprint,
        gpu=gpu.name,
        gpu_count=gpus,
        gpu_memory_bytes=gpu.memory_bytes,
        target_batch=target_batch,
        seq_len=seq_len,
        constraints={
            "methods": [str(m) for m in space.methods],
            "precisions": None if space.precisions is None else [str(p) for p in space.precisions],
            "offload": space.allow_offload,
            "cpu_mem_bytes": space.cpu_mem_bytes if space.allow_offload else None,
            "top_k": top_k,
            # the ranking policy: two requests that differ in it get different answers
            "prefer": str(space.prefer),
            # the recipe settings that differ from the defaults: a stored plan is reused only for the same
            **({"recipe": recipe} if (recipe := _recipe_constraints(space)) else {}),
            **({"schemes": list(space.schemes)} if space.schemes is not None else {}),
        },
        planner_version=__version__,
    )


def _recipe_constraints(space: SearchSpace) -> dict:
    """The space's recipe settings that differ from TrainConfig's defaults, JSON-able (as a QLoRA
    candidate takes them: every setting, the adapters' and the k-bit preparation's too)."""
    given = TrainConfig(method=_QLORA, **space.recipe(_QLORA)).to_dict()
    default = TrainConfig(method=_QLORA).to_dict()
    # (a payload holds the eval settings only where the run evaluates: TrainConfig.to_dict)
    return {f.name: given[f.name] for f in request.RECIPE if given.get(f.name) != default.get(f.name)}










class Speed(NamedTuple):
    """What the ranking reads of a fitting candidate's throughput."""

    tokens_per_s: float


