"""The step as a timeline: what is allocated and freed over one optimizer step.

Forward block by block (the running block's ZeRO-3 parameters, the embeddings' saved tensors,
each block's saved tensors or its checkpoint and the MLP tensors its forward makes and frees,
every tensor it makes and frees in the last block of the first forward (``_forward``), the head's, the logits at the loss), the loss'
backward, the head's (its gradients made, its saved tensors freed), the backward of the last
block (recomputed under checkpointing while every checkpoint is held, with the forward's locals
where the recompute stops; then its MLP output projection's gradients and the gradients at the
activation product), backward block by block (each
block's saved tensors released and its gradients made), the end of backward (the recomputed
block under checkpointing, the embeddings' gradients, a tied embedding's two partial
gradients), and the optimizer step
(ZeRO's flattened gradients, the step's temporaries). With gradient accumulation the first
micro-step is drawn, then the last one, in which the earlier micro-steps' gradients exist; the
ones between repeat the last. A torch optimizer makes its states in the run's first
``optimizer.step()`` (lazy state initialization): that first step comes before, unmarked
(``_first_step``), so the allocator replay sees the states carved from the cache the first
step's activations left, as a real run does (ZeRO-3's flat states too, made inside DeepSpeed's
first ``step()``). Before it, the model states are made in the order and with the temporaries
the sharding library builds them (``ShardingSpec.build_sequence``: ZeRO-3's flat partition, fp32
cast and init gradient buffer).

Each event says which tensors its bytes are (``Event.tensors``, ``Grains``): the loss path's
logits-sized tensors, gradients and the foreach optimizer's temporaries of their parameters'
shapes, the MLP's intermediate-sized tensors, and otherwise equal pieces of one hidden state;
the allocator replay (``planner.memory.allocator``) places each as PyTorch's caching allocator
would.

The moments of ``planner.memory.step.MOMENTS`` are marks on this timeline: at each, the moment's
transient parts are allocated, the mark made, and they are freed (``_instant``); what the walk
holds there is the moment's other parts, and the live bytes at each mark are the moment's total
(checked as the timeline is made). Peak, moment and breakdown are read from here.
Between marks the events are ordered so that no point exceeds the marks around it, which is the
accounting the moments make (measured exact on the CPU rows of bench/accuracy.py): within a
block, backward releases the saved tensors before it makes the gradients; the embeddings'
gradients, and under checkpointing the first block's recompute, are drawn at the end of
backward where the model counts them. The recompute of the last block, the first backward
reaches, is drawn where it runs, with every checkpoint alive (``first_block_recompute``, then
``first_block_backward`` once the output projection's backward ran); the
blocks between are recomputed one at a time while fewer checkpoints and more gradients live,
which those two moments bound. Where the sharding scheme's hooks keep each layer's checkpoint
and input gradient to the end of backward (FSDP1 under transformers 4's reentrant checkpoint,
``step.retention``), no block frees its checkpoint, each block's recompute and backward are drawn
and its input gradient stays, and the two moments are marked at the first layer's backward, which
holds the most (``_retained_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from planner.config import Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memo import IdentityMemo
from planner.memory.activations import (
    block_tensors,
    block_terms,
    breakdown_key,
    builds_logits,
    checkpoint_bytes,
    kv_cache_block_bytes,
    layer_terms,
    model_level_terms,
    shifted_loss_events,
)
from planner.memory.buffers import ROPE_CACHES_KEY, rope_cache_tensors
from planner.memory.dtypes import FP32, HALF, mode_of
from planner.memory.parameters import Trained, lora_targets, trained
from planner.memory.shapes import block_context, dims_of, drops_adapter_inputs
from planner.memory.states import StaticTerms, base_tensor_sizes, static_terms
from planner.memory.step import (
    BLOCK_GRADIENTS,
    HEAD_SAVED,
    MOMENT,
    MOMENTS,
    PHASES,
    RETAINED_KEY,
    BatchTerms,
    StaticSizes,
    batch_moments,
    batch_terms,
    first_block_gradients,
    part_key,
    part_value,
    retention,
    static_moments,
    static_sizes,
)
from planner.memory.wrap import draws_wrap, wrap_ops
from planner.modelspec import LinearKind, ModelSpec
from planner.sharding import BREAKDOWN_KEYS

#: what the picture stacks: each breakdown key's category
CATEGORIES = ("weights", "gradients", "optimizer states", "activations", "logits/loss", "temporaries")


def category(key: str) -> str:
    """The picture's category of a breakdown key (a sharding scheme's: as it declares it)."""
    scheme = BREAKDOWN_KEYS.get(key)
    if scheme is not None:
        return scheme.category
    if key.startswith(("weights", "lora/weights")):
        return "weights"
    if key.startswith("gradients"):
        return "gradients"
    if key.startswith("optimizer_states"):
        return "optimizer states"
    if key.startswith(("logits", "activations/loss", "loop/", "eval/logits")):
        return "logits/loss"
    if key.startswith("optimizer_step"):
        return "temporaries"
    return "activations"


class Event(NamedTuple):
    """One allocation or free of ``nbytes`` under a breakdown key. (An immutable named tuple, not
    a frozen dataclass: a step has hundreds to thousands of events, made for every plan shown,
    and a frozen dataclass takes three times as long to make, 1.5 against 0.45 us.)"""

    op: str
    """``alloc`` or ``free``."""
    key: str
    """The breakdown key the bytes count under."""
    nbytes: int
    tensors: int | tuple[int, ...]
    """How many tensors the bytes are (equal sizes assumed), or their sizes in the order they are
    made (summing to ``nbytes``): the allocator replay's grain (``Grains``)."""
    ident: int
    """Pairs a free with its allocation."""
    where: str
    """When in the step: ``forward block 3``, ``loss``, ``optimizer step``, ..."""


@dataclass(frozen=True)
class Timeline:
    """The events of one optimizer step and the moments marked on it."""

    events: tuple[Event, ...]
    marks: dict[str, int] = field(default_factory=dict)
    """Moment name -> number of events done when it is reached."""
    host: int = 0
    """Host RAM the configuration needs (offload), beside the device's timeline."""
    outside_allocator: int = 0
    """Device bytes outside the caching allocator the step needs (of the paged optimizer states in
    unified memory, those of the tensor stepped: ``StaticTerms.paged_step``)."""
    paged: int = 0
    """Every paged optimizer state in unified memory (``StaticTerms.paged``): resident where the
    device has room, on the host past it (``planner.memory.overhead.paged_on_host``)."""
    start: int = 0
    """Events before the step the moments are read from: the model states, and the run's first
    step when the optimizer makes its states in it (``_first_step``)."""
    fork_tails: tuple[int, ...] = ()
    """Where the timelines of plans that differ in one setting commonly part, each as the number of
    events after it (events added before the step, ``overhead.with_workspaces``', leave it in
    place): the model states made (plans of one model, method and weights' precision share them),
    and the run's first step up to its optimizer step (plans that differ in the optimizer only:
    the states it makes there). The allocator replay keeps its state there for the next timeline
    that begins alike (``allocator.ReplayPrefixes``)."""

    @property
    def forks(self) -> tuple[int, ...]:
        """``fork_tails`` as event counts, ascending, each inside the timeline."""
        n = len(self.events)
        return tuple(sorted({n - after for after in self.fork_tails if 0 < n - after < n}))

    def curve(self) -> list[int]:
        """Live bytes after each event (index 0: before the first)."""
        return list(self._curve)

    @functools.cached_property
    def _curve(self) -> tuple[int, ...]:
        # (by position: a named tuple's field by name is a slower lookup)
        return tuple(itertools.accumulate([ev[2] if ev[0] == "alloc" else -ev[2] for ev in self.events], initial=0))

    def live_at(self, done: int) -> dict[str, int]:
        """Live bytes by breakdown key once ``done`` events happened."""
        live: dict[str, int] = {}
        get = live.get
        for op, key, nbytes, _, _, _ in self.events[:done]:  # (unpacked: see _curve)
            live[key] = get(key, 0) + (nbytes if op == "alloc" else -nbytes)
        return {k: v for k, v in live.items() if v}

    @functools.cached_property
    def peak_phase(self) -> str:
        """The first moment at which live memory is largest."""
        curve = self._curve
        return max(PHASES, key=lambda name: curve[self.marks[name]])

    @functools.cached_property
    def peak(self) -> int:
        curve = self._curve
        peak = max(curve)
        assert peak == curve[self.marks[self.peak_phase]], "a point between the moments exceeds them"
        return peak

    def breakdown(self) -> dict[str, int]:
        return self.live_at(self.marks[self.peak_phase])


#: the loss path's terms, made of whole logits-sized tensors (``Grains.logits``): the logits, their
#: fp32 upcast, log_softmax's output, nll_loss's and log_softmax's gradients
#: (planner/memory/activations.py logits_forward_transient, logits_backward_transient, loss_terms)
_LOGITS_KEYS = frozenset({"logits/transient", "activations/loss/log_softmax", "loop/manual_outputs"})


def whole_tensors(nbytes: int, tensor: int) -> tuple[int, ...]:
    """``nbytes`` as tensors of ``tensor`` bytes, what is left over first (the logits in their
    16-bit dtype before their fp32 upcast; the int64 labels before the log-probabilities)."""
    whole, rest = divmod(nbytes, tensor)
    return ((rest,) if rest else ()) + (tensor,) * whole


def shares(weights: tuple[int, ...], nbytes: int) -> tuple[int, ...] | None:
    """``nbytes`` split in proportion to ``weights`` (element counts of tensors; the last takes
    the remainder of the division), or None when there is nothing to split by."""
    total = sum(weights)
    if total <= 0 or nbytes <= 0:
        return None
    per, left = divmod(nbytes, total)
    if not left and min(weights) > 0:
        # a whole number of bytes per element (a component of one dtype: the weights, gradients, optimizer
        # states and temporaries of every plan shown): each share is exactly its weight times that, multiplied
        # in C (a QLoRA plan's 291 base tensors, a LoRA plan's 512 lazy states, once a timeline each)
        return tuple(map(per.__mul__, weights))
    # each size worked out once: a model's tensors come in a few sizes, repeated in every layer (a LoRA
    # plan's 512 lazy optimizer states, once a timeline, are 2 sizes: one product and division each
    # took 80 us, a third of the run's first step)
    share = {w: nbytes * w // total for w in set(weights[:-1])}
    sizes = list(map(share.__getitem__, weights[:-1]))
    sizes.append(nbytes - sum(sizes))
    return tuple(filter(None, sizes))


#: an event's bytes (``Event.nbytes``, by position)
_NBYTES = operator.itemgetter(2)

#: ``Event(...)`` without its ``__new__``'s Python frame (``collections.namedtuple`` makes ``__new__`` a
#: lambda around ``tuple.__new__``): the builder makes every event of the shown plans' timelines
_new_event = tuple.__new__


class _Builder:
    def __init__(self, unit: int, logits: int = 0, units: dict[str, int] | None = None) -> None:
        self.events: list[Event] = []
        self.marks: dict[str, int] = {}
        self.unit = max(unit, 1)
        self.logits = logits
        self.units = {key: max(size, 1) for key, size in (units or {}).items()}
        self._next = 0
        self._allocs: dict[int, Event] = {}
        self.forks: list[int] = []
        self.moments: dict[str, list[tuple]] = {}  # ``_instant``'s parts, by moment
        self.released: dict[str, int] = {}  # the last block's saved tensors its backward frees, by key (``_released``)
        self.limit = 0  # the step's allocated peak, which ``locals`` stays under
        self.drew_locals = False  # the block forward's locals drawn one by one (``_forward``)
        self.live_marked: dict[str, int] = {}  # the live bytes at each mark (``mark``: ``step_timeline``'s check)

    def grain(self, key: str, nbytes: int) -> int | tuple[int, ...]:
        """The tensors (``Event.tensors``) of an allocation whose tensors are not known: the loss
        path's logits-sized ones, else pieces of its key's unit, 1 to 64."""
        if self.logits and key in _LOGITS_KEYS:
            return whole_tensors(int(nbytes), self.logits)
        tensors = round(nbytes / self.units.get(key, self.unit))
        return 1 if tensors < 1 else 64 if tensors > 64 else tensors  # max(1, min(64, ...)), written out

    def alloc(self, key: str, nbytes: int, where: str, tensors: int | tuple[int, ...] | None = None) -> int:
        self._next = ident = self._next + 1
        if nbytes:
            self._allocs[ident] = event = _new_event(Event, (
                "alloc", key, int(nbytes), self.grain(key, nbytes) if tensors is None else tensors, ident, where))
            self.events.append(event)
        return ident

    def resolved(self, terms: dict[str, int], tensors: dict[str, tuple[int, ...]] | None = None) -> list[tuple]:
        """(key, bytes, tensors) of each term as ``alloc_terms`` allocates it, for ``allocs``."""
        known = tensors or {}
        return [(key, int(nbytes), None if not nbytes else self.grain(key, nbytes) if known.get(key) is None
                 else known[key]) for key, nbytes in terms.items()]

    def allocs(self, terms: list[tuple], where: str) -> list[int]:
        """``alloc_terms`` of terms ``resolved`` once: the blocks' terms are the same in every block
        and micro-step (a step of Llama-2-7B allocates them 96 times)."""
        allocs, events, idents = self._allocs, self.events, []
        ident = self._next
        for key, nbytes, tensors in terms:
            ident += 1
            if nbytes:
                allocs[ident] = event = _new_event(Event, ("alloc", key, nbytes, tensors, ident, where))
                events.append(event)
            idents.append(ident)
        self._next = ident
        return idents

    def alloc_terms(self, terms: dict[str, int], where: str,
                    tensors: dict[str, tuple[int, ...]] | None = None) -> list[int]:
        """One allocation a term; ``tensors``: the terms whose tensors are known (sizes in bytes)."""
        if not tensors:
            return [self.alloc(key, nbytes, where) for key, nbytes in terms.items()]
        return [self.alloc(key, nbytes, where, tensors.get(key)) for key, nbytes in terms.items()]

    def skip(self) -> None:
        """``alloc`` of 0 bytes, whose ident is not kept: no event."""
        self._next += 1

    def free(self, ident: int, where: str) -> None:
        self.free_all((ident,), where)

    def free_all(self, idents: list[int] | tuple[int, ...], where: str) -> None:
        pop, append = self._allocs.pop, self.events.append
        for ident in idents:
            ev = pop(ident, None)  # None: a zero-byte allocation, never made
            if ev is not None:  # (by position: op, key, nbytes, tensors)
                append(_new_event(Event, ("free", ev[1], ev[2], ev[3], ident, where)))

    def locals(self, ops: tuple[tuple[int, str], ...], where: str) -> None:
        """Tensors made and freed in turn (``_Program.ops``), one event each; one that would take the
        live bytes over the step's peak (``limit``) is left out, so no point between the moments
        exceeds them."""
        made: list[int | None] = []
        live = self.live_bytes()
        for size, key in ops:
            if size > 0:
                fits = live + size <= self.limit
                made.append(self.alloc(key, size, where, 1) if fits else None)
                live += size if fits else 0
            elif (ident := made[-1 - size]) is not None:
                live -= self._allocs[ident][2]
                self.free(ident, where)

    def live_bytes(self) -> int:
        """The bytes allocated and not freed, summed over the allocations not freed rather than kept by
        every alloc and free of the step: only ``locals``, the wrap prelude and (with assertions on) ``mark`` read them."""
        return sum(map(_NBYTES, self._allocs.values()))

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)
        if __debug__:
            self.live_marked[name] = self.live_bytes()

    def fork(self) -> None:
        """A point where the timelines of plans that differ in one setting commonly part (``Timeline.fork_tails``)."""
        self.forks.append(len(self.events))


@dataclass(frozen=True)
class _Step:
    """What one micro-step allocates, by part: the moments' sizes, and how the walk between them
    spreads the held ones over the blocks."""

    model: ModelSpec
    config: TrainConfig
    static: StaticTerms
    sizes: StaticSizes
    """The static sizes the moments read (``step.MOMENTS``)."""
    batch: BatchTerms
    """The per-micro-batch terms the moments read; ``batch.head``: the head's saved tensors."""
    first: dict[str, int]
    """the first block's saved tensors by breakdown key (or its checkpoint)"""
    rest: dict[str, int]
    """every other block's"""
    embeddings: dict[str, int]
    block_gradients: int
    """one block's share of the gradients (the rest are the head's and the embeddings')"""
    cache: int
    """one block's KV cache layer, when the forward builds one"""
    head_gradients: int
    """the head's share of the gradients, made before any block's"""
    down_gradients: int
    """the last block's MLP output projection's share, made first in that block"""
    blocks: tuple[dict[str, int], ...] = ()
    """encoder-decoder: every block's saved tensors, encoder then decoder (``first``/``rest`` unused)"""
    grains: "Grains | None" = None
    """the tensors the gradients and the optimizer's temporaries are made of"""
    tensors: tuple[dict[str, tuple[int, ...]], ...] = ({}, {})
    """the first block's and every other block's terms whose tensors are known (bytes each,
    ``activations.block_tensors``), by breakdown key"""
    forward_mlp: tuple[int, ...] = ()
    """under checkpointing, the MLP tensors each block's forward makes and frees, at most alive at
    once (``_forward_mlp``): one event a block"""
    forward_locals: tuple[tuple[int, str], ...] = ()
    """the tensors a block's forward makes and frees, one by one (``_forward_locals``): drawn in the
    last block of the timeline's first forward, in place of ``forward_mlp`` (``_forward``)"""
    retained: int = 0
    """one layer-input gradient the sharding scheme keeps to the end of backward, or 0
    (``step.retention``, ``_retained_backward``)"""

    @property
    def n_blocks(self) -> int:
        return len(self.blocks) if self.blocks else self.model.num_layers

    def block(self, k: int) -> dict[str, int]:
        if self.blocks:
            return self.blocks[k]
        return self.first if k == 0 else self.rest

    def block_tensors(self, k: int) -> dict[str, tuple[int, ...]]:
        """``tensors`` of block ``k`` (none for blocks that differ: ``blocks``)."""
        return {} if self.blocks else self.tensors[k > 0]


def _block_gradient_share(model: ModelSpec, config: TrainConfig, t: Trained, gradients: int) -> int:
    """Gradient bytes of one block, in proportion to its trainable parameters."""
    if not t.count:
        return 0
    if model.is_encoder_decoder:  # the blocks' average share (all gradients exist at backward_end)
        blocks = model.num_layers + model.decoder_layers
        per_layer = (t.count if config.method.uses_adapters else model.num_layers * model.params_per_layer
                     + model.decoder_layers * model.decoder_params_per_layer) // blocks
    else:
        per_layer = t.count // model.num_layers if config.method.uses_adapters else model.params_per_layer
    return gradients * per_layer // t.count


@dataclass(frozen=True)
class Grains:
    """The tensors, as element counts, that the step's per-parameter terms are made of: a
    gradient is a tensor of its parameter's shape (autograd's AccumulateGrad keeps the gradient
    the weight's backward made as ``.grad``), and torch's foreach optimizers make one temporary
    per parameter (``torch._foreach_sqrt(exp_avg_sqs)`` in torch/optim/adamw.py
    _multi_tensor_adamw). The replay places each as the allocator would: a 112 MiB gradient is
    carved from a cached 2 GiB logits block, where an equal share of the block's bytes, a tensor
    of a size no real one has, may fit nowhere and open a segment of its own."""

    block: tuple[int, ...]
    """one block's trainable tensors in the order its backward makes their gradients (the MLP's
    output projection first, back to the attention's inputs, then the norms)"""
    down: tuple[int, ...]
    """the MLP output projection's, which the last block's backward makes first"""
    head: tuple[int, ...]
    """the head's (full fine-tuning: the lm_head or a tied head's partial, the final norm)"""
    embeddings: tuple[int, ...]
    """what the end of backward makes (full fine-tuning: the embeddings')"""
    params: tuple[int, ...]
    """every trainable tensor, in the model's order (the optimizer's lists)"""


def _grains(model: ModelSpec, config: TrainConfig, t: Trained) -> Grains | None:
    """The step's parameter tensors (``Grains``) of a decoder-only or encoder-only model (None
    for an encoder-decoder: its two stacks keep the default grain)."""
    if model.is_encoder_decoder or not t.count:
        return None
    down: list[int] = []
    others: list[int] = []
    adapters = config.method.uses_adapters
    for lin in reversed(t.targets if adapters else model.layer_linears):
        if adapters:  # backward: lora_B's gradient, then lora_A's
            one = [r * lin.out_features, r * lin.in_features] * lin.count if (r := config.lora_r or 0) else []
        else:
            one = ([lin.in_features * lin.out_features] + [lin.out_features] * lin.bias) * lin.count
        (down if lin.kind is LinearKind.MLP_OUT else others).extend(one)
    if adapters:
        return Grains(block=tuple(down + others), down=tuple(down), head=(), embeddings=(), params=t.sizes)
    norms = model.layer_norm_params + model.layer_other_params
    others += [min(norms - start, model.hidden_size) for start in range(0, norms, model.hidden_size)]
    head = (model.head_params + (model.lm_head_params if model.tied_embeddings else 0), model.final_norm_params)
    embeddings = (model.embedding_params, model.other_embedding_params)
    return Grains(block=tuple(down + others), down=tuple(down), head=tuple(n for n in head if n),
                  embeddings=tuple(n for n in embeddings if n), params=t.sizes)


class _Activations(NamedTuple):
    """What a micro-step saves and makes besides the model states: ``_Step``'s fields of the same names."""

    first: dict[str, int]
    rest: dict[str, int]
    tensors: tuple[dict[str, tuple[int, ...]], ...]
    blocks: tuple[dict[str, int], ...]
    embeddings: dict[str, int]
    batch: BatchTerms
    cache: int
    forward_mlp: tuple[int, ...]
    forward_locals: tuple[tuple[int, str], ...]
    retained: int


#: every field of a configuration but the optimizer: the key of ``_Activations`` shared between plans
#: (none of the activations' terms reads the optimizer; its states, temporaries and the sharding's
#: checks of it are the static terms': tests/memory/test_timeline.py holds twins' activations equal)
_BUT_OPTIMIZER = operator.attrgetter(*[f.name for f in dataclasses.fields(TrainConfig) if f.name != "optimizer"])


def _step_parts(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, shared: dict | None = None) -> _Step:
    """``shared``: the ``_Activations`` of the timelines made before, of this model and kernels, by
    ``_BUT_OPTIMIZER`` (the plans a search shows commonly differ in the optimizer only: Llama-2-7B on
    an A10G, target batch 32, 17 timelines of 7 activations)."""
    t = trained(model, config)
    static = static_terms(model, config, kernels, t)
    dims, mode = dims_of(model, config), mode_of(config)
    key = _BUT_OPTIMIZER(config) if shared is not None else None
    acts = shared.get(key) if shared is not None else None
    if acts is None:
        acts = _activations(model, config, kernels, t, dims, mode)
        if shared is not None:
            shared[key] = acts
    head_gradients, down_gradients = first_block_gradients(model, config, static.gradients, t)
    return _Step(
        model=model, config=config, static=static, first=acts.first, rest=acts.rest, blocks=acts.blocks,
        embeddings=acts.embeddings,
        sizes=static_sizes(static, accumulating=config.grad_accum > 1, head_grads=head_gradients,
                           down_grads=down_gradients),
        batch=acts.batch,
        block_gradients=_block_gradient_share(model, config, t, static.gradients),
        cache=acts.cache,
        head_gradients=head_gradients, down_gradients=down_gradients, grains=_grains(model, config, t),
        tensors=acts.tensors, forward_mlp=acts.forward_mlp, forward_locals=acts.forward_locals, retained=acts.retained,
    )


def _activations(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, t: Trained, dims,
                 mode) -> _Activations:
    """``config``'s ``_Activations``: its blocks' saved terms (and tensors), the model-level terms that
    are not the head's, its batch terms, KV cache layer, forward locals and retained gradient."""
    tensors: tuple[dict[str, tuple[int, ...]], ...] = ({}, {})
    forward_mlp: tuple[int, ...] = ()
    if config.grad_ckpt:
        forward_mlp = _forward_mlp(model, config, kernels, t, dims, mode)
        first = rest = {"activations/checkpoints": checkpoint_bytes(model, dims, mode)}
    else:
        keyed = lambda terms: {breakdown_key(k): v for k, v in terms.items() if v}  # noqa: E731
        contexts = [block_context(model, config, kernels, first=f, targets=t.target_names, dims=dims)
                    for f in (True, False)]
        first, rest = (keyed(block_terms(ctx)) for ctx in contexts)
        tensors = tuple(keyed(block_tensors(ctx)) for ctx in contexts)
    blocks: tuple[dict[str, int], ...] = ()
    if model.is_encoder_decoder:
        from planner.memory.encdec import timeline_parts

        embeddings, block_list, _ = timeline_parts(model, config, kernels, t.target_names)
        blocks = tuple(block_list)
    else:  # the model-level terms that are not the head's: token ids, rotary tables, the embedding norm's input
        level = model_level_terms(model, config, dims, mode, kernels)
        embeddings = {breakdown_key(k): v for k, v in level.items() if v and k not in HEAD_SAVED}
        if model.other_blocks and not config.grad_ckpt:  # blocks that differ (dense and MoE): each its own
            blocks = tuple({breakdown_key(k): v for k, v in terms.items() if v}
                           for terms in layer_terms(model, config, kernels, t.target_names, dims))
    return _Activations(first, rest, tensors, blocks, embeddings, batch_terms(model, config, kernels, t.target_names),
                        kv_cache_block_bytes(model, config, dims, mode), forward_mlp,
                        _forward_locals(model, config, kernels, t, dims, mode, forward_mlp), retention(model, config))


#: the breakdown keys of the forward's locals: the MLP's intermediate-sized tensors, every other one
_MLP_LOCALS = "activations/mlp/intermediate"
_LOCALS = "activations/block_locals"


class _Program:
    """The tensors a block's forward makes and frees in the order it does: ``ops`` holds
    (size, key) for an allocation and (-1 - n, "") for the free of the n-th allocation."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, str]] = []
        self.made = 0

    def alloc(self, size: int, key: str = _LOCALS) -> int | None:
        if size <= 0:
            return None
        self.ops.append((size, key))
        self.made += 1
        return self.made - 1

    def free(self, *made: int | None) -> None:
        self.ops += [(-1 - n, "") for n in made if n is not None]


def _plain_block(model: ModelSpec) -> bool:
    """A pre-norm decoder block of RMSNorm, rotary attention over separate q/k/v projections and
    a gated MLP (Llama, Mistral, Qwen2), whose forward ``_block_program`` follows."""
    kinds = [lin.kind for lin in model.layer_linears]
    return (model.norm == "rmsnorm" and model.norm_placement == "pre" and not model.parallel_block
            and model.gated_mlp and model.position == "rope" and not model.qk_norm and not model.num_experts
            and not model.attn_output_gate and not model.hidden_dropout and not model.other_blocks
            and not model.is_encoder_decoder and model.mixer == "attention"
            and kinds == [LinearKind.ATTN_IN] * 3 + [LinearKind.ATTN_OUT] + [LinearKind.MLP_IN] * 2 + [LinearKind.MLP_OUT]
            and all(lin.module and lin.count == 1 and lin.active == 1 for lin in model.layer_linears))


def _norm(p: _Program, tokens: int, h: int, residual: int) -> int | None:
    """RMSNorm's forward (transformers 5.24 models/mistral/modeling_mistral.py l.192-197,
    MistralRMSNorm: ``hidden_states.to(torch.float32)``, ``pow(2).mean``, ``* torch.rsqrt``,
    ``self.weight * hidden_states.to(input_dtype)``): fp32 pieces of the hidden state, its output in
    the residual stream's dtype (the weight's: fp32 under autocast or k-bit upcast)."""
    n = tokens * h
    up = p.alloc(n * FP32) if residual != FP32 else None  # .to(torch.float32) of a 16-bit stream
    sq = p.alloc(n * FP32)  # pow(2), gone once mean ran
    p.free(sq)
    scaled = p.alloc(n * FP32)
    p.free(up)
    down = p.alloc(n * residual) if residual != FP32 else None  # .to(input_dtype)
    out = p.alloc(n * residual)
    p.free(down, scaled)
    return out


def _linear(p: _Program, lin, tokens: int, in_dtype: int, out_dtype: int, ctx: "_LocalsContext",
            key: str = _LOCALS) -> int | None:
    """One projection of ``in_dtype`` input: its output, with what it makes and frees on the way.

    * autocast casts the input to 16 bits for each call (torch autocast's fp16 cast policy for
      ``linear``; nothing keeps the cast in a checkpointed forward);
    * QLoRA: bitsandbytes 0.50.2 Linear4bit.forward (nn/modules.py l.626-637) casts the input to
      its compute dtype and the output back to the input's (``matmul_4bit(...).to(inp_dtype)``);
      MatMul4Bit's forward dequantises the whole weight to the compute dtype before its matmul once
      the tokens exceed 1536 (backends/cuda/ops.py l.954-967, ``_dequant_linear_fallback``
      l.914-916 ``B_dq = torch.empty(shapeB, dtype=A.dtype)``; older releases always, autograd/
      _functions.py l.446 ``F.dequantize_4bit(B, quant_state).to(A.dtype)``), freed once it returns;
    * LoRA (peft 0.21 tuners/lora/layer.py l.1082-1113, Linear.forward): ``result =
      self.base_layer(x)``, then ``result + lora_B(lora_A(dropout(x))) * scaling``: lora_B's output,
      its scaled copy and the sum, in the adapter's dtype promoted with the base output's, cast
      back to it (``result.to(torch_result_dtype)``); lora_A's tokens x r output is left out
      (under a MiB at the ranks planned)."""
    n_in, n_out = tokens * lin.in_features, tokens * lin.out_features
    qlora = ctx.qlora
    work = ctx.bnb if qlora else (HALF if ctx.autocast else out_dtype)
    cast = p.alloc(n_in * work) if (qlora or ctx.autocast) and in_dtype != work else None
    weight = p.alloc(lin.in_features * lin.out_features * ctx.bnb) if qlora and tokens > BNB_FUSED_MAX_TOKENS else None
    out = p.alloc(n_out * work, key)
    p.free(weight, cast)
    if qlora and work != in_dtype:
        raw, out = out, p.alloc(n_out * in_dtype, key)  # .to(inp_dtype)
        p.free(raw)
    base = in_dtype if qlora else work
    if lin.name not in ctx.targets:
        return out
    # x = self._cast_input_dtype(x, lora_A.weight.dtype) (l.1100): a copy where the dtypes differ (bnb's
    # Linear4bit LoRA casts only outside autocast, peft tuners/lora/bnb.py ``requires_conversion``)
    adapter_in = in_dtype if in_dtype == ctx.adapter_weight or (qlora and ctx.autocast) else ctx.adapter_weight
    x_cast = p.alloc(n_in * adapter_in) if adapter_in != in_dtype else None
    if ctx.dropout_mask:  # nn.Dropout's output and its mask, gone once lora_A read them
        p.free(p.alloc(n_in * adapter_in), p.alloc(n_in * ctx.dropout_mask))
    a = ctx.adapter
    summed = max(base, a)
    b_out = p.alloc(n_out * a, key)
    scaled = p.alloc(n_out * a, key)
    p.free(b_out)
    total = p.alloc(n_out * summed, key)
    p.free(scaled, out)
    if summed != base:
        total, wide = p.alloc(n_out * base, key), total
        p.free(wide)
    p.free(x_cast)
    return total


def _rotary(p: _Program, n: int) -> int | None:
    """``(q * cos) + (rotate_half(q) * sin)`` (modeling_mistral.py l.51-55, l.79-80: rotate_half's
    ``torch.cat((-x2, x1))``; cos and sin cast to q's dtype) for one of q and k of ``n`` bytes."""
    cos = p.alloc(n)
    neg = p.alloc(n // 2)
    cat = p.alloc(n)
    p.free(neg)
    sin = p.alloc(n)
    p.free(cat)
    out = p.alloc(n)
    p.free(cos, sin)
    return out


class _LocalsContext(NamedTuple):
    targets: frozenset[str]
    autocast: bool
    qlora: bool
    bnb: int
    """bytes of bitsandbytes' compute dtype (the dequantised weight, the 4-bit matmul's output)"""
    adapter: int
    adapter_weight: int
    dropout_mask: int
    """bytes per element of LoRA dropout's mask (0: no dropout)"""


def _block_program(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, t: Trained, dims, mode) -> _Program:
    """A checkpointed decoder block's forward (``_plain_block``), tensor by tensor, as
    MistralDecoderLayer.forward runs it (modeling_mistral.py l.213-241; MistralAttention.forward
    l.140-178, MistralMLP.forward l.46-47) with nothing saved (torch 2.13 torch/utils/checkpoint.py:
    reentrant under ``torch.no_grad()``, l.273-274; non-reentrant packs a ``_Holder``, l.1153-1157):
    each tensor freed once its last reader ran, as a real 2-layer Mistral-shaped run's c10
    allocator events show (bench/reserve_trace.py). The block's input and output are the
    checkpoints the timeline draws; the attention kernel's own scratch, LoRA's tokens x r tensors
    and the views (transpose, reshape) are left out."""
    e, h = dims.tokens, dims.h
    r = mode.residual
    ctx = _LocalsContext(targets=frozenset(t.target_names) if config.method.uses_adapters else frozenset(),
                         autocast=mode.autocast, qlora=config.method is Method.QLORA,
                         bnb=config.precision.compute_bytes, adapter=mode.adapter, adapter_weight=mode.adapter_weight,
                         dropout_mask=kernels.dropout_mask_bytes(mode.adapter_weight) if drops_adapter_inputs(config) else 0)
    out_c = r if ctx.qlora else mode.compute  # a 4-bit projection returns its input's dtype
    q_lin, k_lin, v_lin, o_lin, gate_lin, up_lin, down_lin = model.layer_linears
    p = _Program()
    x = _norm(p, e, h, r)
    q = _linear(p, q_lin, e, r, out_c, ctx)
    k = _linear(p, k_lin, e, r, out_c, ctx)
    v = _linear(p, v_lin, e, r, out_c, ctx)
    q_rot = _rotary(p, e * q_lin.out_features * out_c)
    k_rot = _rotary(p, e * k_lin.out_features * out_c)
    p.free(q, k)
    attn = e * dims.a * dims.d
    # SDPA under autocast casts an fp32 q/k/v (QLoRA's upcast stream) to 16 bits; its output
    casts = [p.alloc(n * mode.attn) for n in (attn, e * k_lin.out_features, e * v_lin.out_features)
             if out_c != mode.attn]
    core = p.alloc(attn * mode.attn)
    p.free(*casts)
    o = _linear(p, o_lin, e, mode.attn, mode.attn if ctx.qlora else mode.compute, ctx)
    p.free(core, q_rot, k_rot, v, x)
    mid = p.alloc(e * h * r)  # ``residual + hidden_states``
    p.free(o)
    x = _norm(p, e, h, r)
    gate = _linear(p, gate_lin, e, r, out_c, ctx, _MLP_LOCALS)
    act = p.alloc(e * gate_lin.out_features * out_c, _MLP_LOCALS)
    p.free(gate)
    up = _linear(p, up_lin, e, r, out_c, ctx, _MLP_LOCALS)
    product = p.alloc(e * up_lin.out_features * out_c, _MLP_LOCALS)
    p.free(act, up)
    down = _linear(p, down_lin, e, out_c, out_c, ctx)
    p.free(product, x, down, mid)
    return p


def _forward_mlp(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, t: Trained, dims, mode) -> tuple[int, ...]:
    """The MLP tensors a checkpointed block's forward makes and frees, at most alive at once. The
    forward keeps nothing but the block's input (torch 2.13 torch/utils/checkpoint.py: reentrant,
    transformers 4's default, runs it under ``torch.no_grad()``, l.273-274; non-reentrant,
    transformers 5's, l.1153-1157, packs a ``_Holder`` instead of the tensor), so each tensor
    dies once its last reader ran. In MistralMLP.forward (transformers 5.24
    models/mistral/modeling_mistral.py l.46-47, LlamaMLP alike) ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))`` the gate's output dies inside the activation, and act(gate), up(x) and their
    product are alive together: three 112 MiB tensors a block in a real 2-layer Mistral-shaped
    LoRA run at 2048 fp32 tokens (bench/reserve_trace.py); an ungated MLP's fc1 output and its
    activation. No more than the block saves of them without checkpointing (``mlp/intermediate``),
    which the recompute rebuilds: the forward's point stays under the recompute's moment. They
    change no peak, only the allocator's cache: without them the replay's first step carved the
    250 MiB logits from fresh segments, where the real forward had split the cache into 112 MiB
    blocks first."""
    if not model.has_mlp or model.other_blocks or model.is_encoder_decoder:
        return ()
    ctx = block_context(model, config, kernels, first=False, targets=t.target_names, dims=dims)
    saved = block_terms(ctx).get("mlp/intermediate", 0)
    unit = dims.tokens * model.intermediate_size * mode.compute
    alive = min(3 if model.gated_mlp else 2, saved // unit) if unit else 0
    return (unit,) * alive


#: bitsandbytes' CUDA gemm_4bit runs its own kernel up to this many tokens and dequantises the whole
#: weight past it (bitsandbytes 0.50.2 backends/cuda/ops.py l.926 ``_gemm_4bit_custom_max_m = 1536``, l.954)
BNB_FUSED_MAX_TOKENS = 1536


def _dequantised(model: ModelSpec, config: TrainConfig) -> tuple[int, ...]:
    """QLoRA: the bytes of each 4-bit weight dequantised whole, in the block's forward order (its
    module linears; a stack of experts, one expert at a time), in bitsandbytes' compute dtype."""
    if config.method is not Method.QLORA or model.other_blocks or model.is_encoder_decoder:
        return ()
    return tuple(lin.in_features * lin.out_features * config.precision.compute_bytes
                 for lin in model.layer_linears if lin.module for _ in range(lin.count))


def _dequant_program(weights: tuple[int, ...], p: _Program) -> _Program:
    """Each weight dequantised, then freed once its matmul returned (onto ``p``)."""
    for size in weights:
        p.free(p.alloc(size))
    return p


def _forward_locals(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, t: Trained, dims,
                    mode, forward_mlp: tuple[int, ...]) -> tuple[tuple[int, str], ...]:
    """The tensors a block's forward makes and frees (``_Program.ops``): under checkpointing the
    forward keeps nothing but the block's input, so each tensor dies once its last reader ran;
    without it, QLoRA's dequantised weights (the rest is saved: the block's terms). They change no
    allocated peak (each is drawn only where the live bytes stay under the step's peak:
    ``_Builder.locals``), only the allocator's cache: without them the replay's first step carved
    the 250 MiB logits from fresh segments, where the real forward had split the cache into
    blocks of these sizes first (a real 2-layer Mistral-shaped LoRA run at 2048 fp32 tokens,
    bench/reserve_trace.py: its pool over the allocated peak 449 MiB replayed from its real
    sequence, 85 MiB from the timeline without them). Empty where they would be ``_forward_mlp``'s
    tensors alone (``forward_mlp``: ``_forward_mlp``'s, which the blocks drawn as one event make)."""
    dequantised = _dequantised(model, config) if dims.tokens > BNB_FUSED_MAX_TOKENS else ()
    p = _dequant_program(dequantised, _Program())
    if not config.grad_ckpt:  # the rest of the forward's tensors are saved (the block's terms)
        return tuple(p.ops)
    if _plain_block(model):
        return tuple(_block_program(model, config, kernels, t, dims, mode).ops)
    if not dequantised:
        return ()
    p.free(*[p.alloc(size, _MLP_LOCALS) for size in forward_mlp])
    return tuple(p.ops)


def _forward(b: _Builder, s: _Step, label: str) -> tuple[list[int], list[int], list[list[int]], list[int], list[int]]:
    """Forward up to the loss: the (gathered, embeddings, blocks, head, KV cache) allocations.

    Each block makes and frees its MLP's tensors as one event (``_Step.forward_mlp``), but the last
    block of the timeline's first forward, which draws every tensor its forward makes and frees
    one by one (``_Step.forward_locals``, 62-138 events for Llama-2-7b where the rest of the
    timeline has about 440): that block's locals are what the head's logits, the step's largest
    request, meet in the cache, and a transient of one size made and freed in every block, or in
    every step, takes the same cached block after its first time. Drawn in every block of every
    forward instead (8,700-12,400 events, 4-6 times the replay's time), they move the fms
    Mistral nvidia-smi rows less (bench/published.py: stated reserve rows within 5% 14 of 41,
    against 18 of 41 drawn once; 13 of 41 with neither) and their LoRA rows the wrong way."""
    scheme = s.config.sharding.spec
    gathered = b.alloc(scheme.step_key("gathered"), s.static.gathered, f"{label}forward")
    held = b.alloc(scheme.step_key("held"), s.static.held, f"{label}forward")
    embeddings = b.alloc_terms(s.embeddings, f"{label}embeddings")
    blocks, cache = [], []
    layers, kv = s.model.num_layers, b.resolved({"kv_cache": s.cache})
    alike = None if s.blocks else [b.resolved(s.block(k), s.block_tensors(k)) for k in (0, 1)]  # first, the rest
    released = _released(s)
    for k in range(s.n_blocks):
        where = f"{label}forward block {k + 1}"
        if released and k == s.n_blocks - 1:
            blocks.append(_last_block(b, s, released, where))
        else:
            blocks.append(b.allocs(alike[k > 0], where) if alike else b.alloc_terms(s.block(k), where, s.block_tensors(k)))
        if s.forward_locals and k == s.n_blocks - 1 and not b.drew_locals:
            b.drew_locals = True  # (``_Step.forward_locals``: once, see ``_forward``)
            b.locals(s.forward_locals, where)
        elif s.forward_mlp:
            b.free(b.alloc(_MLP_LOCALS, sum(s.forward_mlp), where, s.forward_mlp), where)
        if k >= layers:  # batch_terms counts num_layers cache layers
            continue
        if s.cache:
            cache += b.allocs(kv, where)
        else:  # (no cache: its ident taken, no event, nothing to free, as ``alloc`` of 0 bytes)
            b.skip()
    saved = s.batch.head
    if s.config.loss_shift:  # its log-probabilities are made among the loss' own events (_loss_instant)
        saved = {key: nbytes for key, nbytes in saved.items() if key != _LOG_SOFTMAX}
    head = b.alloc_terms(saved, f"{label}head and loss")
    return [gathered, held], embeddings, blocks, head, cache


_LOG_SOFTMAX = "activations/loss/log_softmax"


def _released(s: _Step) -> dict[str, int]:
    """Without checkpointing, what the last block's MLP output projection saved, by breakdown key,
    released once its backward ran (``activations._block_backward_at``' negative terms): the first
    block backward reaches frees these saved tensors before it makes its gradients."""
    return {key: -nbytes for key, nbytes in s.batch.block_backward.items() if nbytes < 0}


def _last_block(b: _Builder, s: _Step, released: dict[str, int], where: str) -> list[int]:
    """The last block's saved tensors, those of ``released`` allocated apart, after the rest of
    their term (the output projection's are the last the block's forward makes; of a term whose
    tensors are known, the last tensors), so that its backward frees them (``Builder.released``)."""
    k = s.n_blocks - 1
    terms, known = s.block(k), s.block_tensors(k)
    kept = {key: nbytes - released.get(key, 0) for key, nbytes in terms.items()}
    assert all(v >= 0 for v in kept.values()) and released.keys() <= terms.keys(), (released, terms)
    tensors: dict[str, tuple[int, ...]] = {}
    tails: dict[str, tuple[int, ...]] = {}
    for key, sizes in known.items():
        cut = len(sizes)
        while key in released and cut and sum(sizes[cut - 1:]) <= released[key]:
            cut -= 1
        tensors[key], tails[key] = sizes[:cut], sizes[cut:]
    idents = b.alloc_terms(kept, where, {key: t for key, t in tensors.items() if sum(t) == kept[key]} or None)
    b.released = {key: b.alloc(key, nbytes, where, tails.get(key) if sum(tails.get(key, ())) == nbytes else None)
                  for key, nbytes in released.items()}
    return idents + list(b.released.values())


def _loss_instant(b: _Builder, s: _Step, name: str, mark: bool, where: str, made: dict[str, int]) -> None:
    """The moment ``name`` (``forward`` or ``backward_start``) of transformers <= 4.45's loss
    (``TrainConfig.loss_shift``): its events in their order (``activations.shifted_loss_events``; the
    log-probabilities the head's saved term), where ``_instant`` would allocate the moment's logits
    at once. ``made``: the loss' live tensors by name, across the two."""
    assert [part.key for part in MOMENT[name].transients] == ["logits/transient"], name
    events = shifted_loss_events(dims_of(s.model, s.config), mode_of(s.config), s.config)
    for op, tensor, key, sizes in events[name != "forward"]:
        if op == "mark":
            if mark:
                b.mark(name)
        elif op == "alloc":
            made[tensor] = b.alloc(key, sum(sizes), where, sizes)
        else:
            b.free(made.pop(tensor), where)


def _instant(b: _Builder, s: _Step, name: str, mark: bool, where: str, incoming: bool = False) -> None:
    """A moment of the step (``step.MOMENT``): its transient parts allocated, the moment marked
    (``mark``: on the micro-step the moments are read from), and they are freed. ``incoming``: the
    last block's backward under retention (``_retained_backward``), whose incoming gradient is its
    own transient, where the moment's counts it retained."""
    cached = name + " incoming" if incoming else name
    parts = b.moments.get(cached)
    if parts is None:  # (each moment's parts are the same in every micro-step)
        parts = b.moments[cached] = _transients(b, s, name, s.retained if incoming else 0)
    made: list[int] = []
    for part, terms in parts:
        if terms is None:
            mark = _checks_then_flatten(b, s, part, name, mark, where)
        elif part is _RELEASE:
            b.free_all([b.released.pop(key) for key in terms], where)
        else:
            made += b.allocs(terms, where)
    if mark:
        b.mark(name)
    b.free_all(made, where)


#: ``_transients``' entry for the saved tensors a moment frees for good (``_released``)
_RELEASE = "release"


def _transients(b: _Builder, s: _Step, name: str, incoming: int = 0) -> list[tuple]:
    """(part, its allocations ``resolved``) of each transient part of the moment ``name``; None for
    a flatten the library's checks come before (``_checks_then_flatten``). ``incoming``: the bytes of
    a block's incoming gradient to add back to the block's gradients (``_instant``)."""
    out: list[tuple] = []
    for part in MOMENT[name].transients:
        value = part_value(part, s.sizes, s.batch)
        if incoming and part.by_key:
            value = dict(value)
            value[BLOCK_GRADIENTS] = value.get(BLOCK_GRADIENTS, 0) + incoming
        if part.size == "gradient_flatten" and s.static.step_checks:
            out.append((part, None))
        elif part.by_key:
            # a negative term (``_released``): the saved tensors the moment frees, before it allocates
            if any(nbytes < 0 for nbytes in value.values()):
                out.append((_RELEASE, [key for key, nbytes in value.items() if nbytes < 0]))
                value = {key: nbytes for key, nbytes in value.items() if nbytes > 0}
            out.append((part, b.resolved(value)))
        elif part.key == "optimizer_step/transient":
            out.append((part, b.resolved({part.key: value}, {part.key: _optimizer_grain(s, value)})))
        else:
            key = part_key(part, s.config.sharding.spec)
            out.append((part, b.resolved({key: value}, {key: part.tensors})))
    return out


def _checks_then_flatten(b: _Builder, s: _Step, part, name: str, mark: bool, where: str) -> bool:
    """The library's checks of the gradients (``StaticTerms.step_checks``), each made and freed
    in turn, then its flatten (``part``, the moment's other transient): the moment is marked at
    the largest, the first of them where two are as large. Returns whether the moment is still to
    be marked (the caller's ``mark``)."""
    flatten = s.static.zero_gradient_flatten
    most = s.sizes.gradient_flatten
    spec = s.config.sharding.spec
    t = trained(s.model, s.config)
    for key, nbytes in spec.stream_checks(t, s.config):  # below the flatten: never the mark
        b.free(b.alloc(key, nbytes, where, 1), where)
    for key, nbytes in s.static.step_checks:
        ident = b.alloc(key, nbytes, where, 1)
        if mark and nbytes == most:
            b.mark(name)
            mark = False
        b.free(ident, where)
    tensors = spec.gradient_flatten_tensors(t, s.config)
    ident = b.alloc(part_key(part, spec), flatten, where, tensors or part.tensors)
    if mark and flatten == most:
        b.mark(name)
        mark = False
    b.free(ident, where)
    return mark


def _grain(tensors: tuple[int, ...] | None, nbytes: int) -> tuple[int, ...] | None:
    """An allocation's tensors: ``nbytes`` in proportion to ``tensors`` (None: the default grain)."""
    return shares(tensors, nbytes) if tensors else None


def _optimizer_grain(s: _Step, nbytes: int) -> tuple[int, ...] | None:
    """The optimizer step's temporaries: a whole number of bytes per element of every trainable
    tensor is a foreach list, one temporary per parameter (torch/optim/adamw.py
    _multi_tensor_adamw: ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``); any other
    (a per-tensor loop's temporaries of the largest parameter, bitsandbytes' blocks) keeps the
    default grain, as does ZeRO's step over one flat partition."""
    g = s.grains
    if g is None or s.config.sharding.spec.flat_optimizer or not nbytes or nbytes % sum(g.params):
        return None
    return shares(g.params, nbytes)


def _micro_step(b: _Builder, s: _Step, *, grads_exist: bool, label: str, marks: bool,
                previous: int) -> tuple[list[int], int]:
    """One micro-step's forward and backward; returns the gradient allocations it made and what
    its outputs keep (a hand-written loop's outputs: alive until the next forward returns, when
    ``previous``, the outputs the loop still held, are released)."""
    gathered, embeddings, blocks, head, cache = _forward(b, s, label)
    loss: dict[str, int] = {}  # transformers <= 4.45's loss tensors (loss_shift), by name
    if s.config.loss_shift:
        _loss_instant(b, s, "forward", marks, f"{label}loss", loss)
    else:
        _instant(b, s, "forward", marks, f"{label}loss")
    b.free(previous, f"{label}outputs replaced")
    b.free_all(cache, f"{label}loss")
    held = gathered.pop()  # FSDP2's root unit: unsharded until the end of backward
    b.free_all(gathered, f"{label}loss")
    outputs = b.alloc("loop/manual_outputs", s.batch.kept, f"{label}loss")
    if s.config.loss_shift:
        _loss_instant(b, s, "backward_start", marks, f"{label}loss backward", loss)
    else:
        _instant(b, s, "backward_start", marks, f"{label}loss backward")
    b.free_all(head, f"{label}head backward")
    gathered = b.alloc(s.config.sharding.spec.step_key("gathered"), s.static.gathered, f"{label}backward")
    grads: list[int] = []
    layers = s.n_blocks
    g = s.grains
    if not grads_exist:
        grads.append(b.alloc("gradients", s.head_gradients, f"{label}head backward", _grain(g and g.head, s.head_gradients)))
    kept: list[int] = []
    if s.retained:
        kept = _retained_backward(b, s, embeddings, grads, grads_exist=grads_exist, label=label, marks=marks)
    else:
        _backward_blocks(b, s, blocks, embeddings, grads, grads_exist=grads_exist, label=label, marks=marks)
    where = f"{label}end of backward"
    if not grads_exist:
        rest = s.static.gradients - s.block_gradients * layers - s.head_gradients
        grads.append(b.alloc("gradients", rest, where, _grain(g and g.embeddings, rest)))
    _instant(b, s, "backward_end", marks, where)
    b.free(gathered, where)
    b.free(held, where)
    # FSDP1's final callback: each unit's ``_finalize_params`` drops its hooks, and with them the
    # layer's retained checkpoint input and gradient (torch fsdp/_runtime_utils.py
    # ``_post_backward_final_callback``: ``_catch_all_reshard`` then ``_finalize_params``, unit by unit)
    for k, retained in enumerate(reversed(kept)):
        b.free_all(blocks[k] + [retained], where)
    return grads, outputs


def _backward_blocks(b: _Builder, s: _Step, blocks: list[list[int]], embeddings: list[int], grads: list[int], *,
                     grads_exist: bool, label: str, marks: bool) -> None:
    """Backward block by block (the module's docstring): the last block's, recomputed under
    checkpointing with every checkpoint held, at the moments of ``step.MOMENTS``; then each
    block's saved tensors released and its gradients made."""
    layers = s.n_blocks
    g = s.grains
    # the last block's backward: recomputed under checkpointing with every checkpoint held
    where = f"{label}backward block {layers}"
    _instant(b, s, "first_block_recompute", marks, where)
    if not grads_exist:
        grads.append(b.alloc("gradients", s.down_gradients, where, _grain(g and g.down, s.down_gradients)))
    _instant(b, s, "first_block_backward", marks, where)
    # every block but the last makes its whole share of the gradients, each split alike (once a step)
    block_grads = None if grads_exist else b.resolved({"gradients": s.block_gradients},
                                                      {"gradients": _grain(g and g.block, s.block_gradients)})
    for k in reversed(range(layers)):
        where = f"{label}backward block {k + 1}"
        b.free_all(blocks[k] if k else blocks[0] + embeddings, where)
        if block_grads is None:
            continue
        if k == layers - 1 and s.down_gradients:  # the rest of the last block's share
            made = s.block_gradients - s.down_gradients
            grads.append(b.alloc("gradients", made, where, _grain(g and g.block[len(g.down):], made)))
        else:
            grads += b.allocs(block_grads, where)


def _retained_backward(b: _Builder, s: _Step, embeddings: list[int], grads: list[int], *, grads_exist: bool,
                       label: str, marks: bool) -> list[int]:
    """Backward block by block when the sharding scheme's hooks keep each layer's checkpoint input
    and input gradient to the end of backward (``step.retention``: FSDP1 under transformers 4's
    reentrant checkpoint). Every block is recomputed and runs its backward as the last one does
    (its two instants: at the end of its recompute and at its MLP's activation product); its input
    gradient then stays, and so does its checkpoint: no block frees its saved tensors before the end
    of backward. The first layer's backward, holding the most, is where the two moments of the last
    block's backward are marked (``step.BatchTerms.retained``): every gradient made there counts as
    a block's incoming one, but the last block's, which the head's backward made (not retained: it
    is drawn with the block's other transients, ``incoming``). The blocks' own gradients (the
    adapters' shards on FSDP1's post-backward stream: a pool of their own on more than one GPU,
    ``FSDP1.streams``) are drawn after that mark, at the end of backward where the moments count
    them, as the embeddings' are: beside the first layer's output projection's, the moments hold
    the head's only. Returns the retained gradients' allocations, the last block's first."""
    layers, g, kept = s.n_blocks, s.grains, []
    for k in reversed(range(layers)):
        where = f"{label}backward block {k + 1}"
        first, last = k == 0, k == layers - 1
        _instant(b, s, "first_block_recompute", marks and first, where, incoming=last)
        if first and not grads_exist:
            grads.append(b.alloc("gradients", s.down_gradients, where, _grain(g and g.down, s.down_gradients)))
        _instant(b, s, "first_block_backward", marks and first, where, incoming=last)
        if first:
            b.free_all(embeddings, where)
        kept.append(b.alloc(RETAINED_KEY, s.retained, where, 1))
    if not grads_exist:
        where = f"{label}end of backward"
        made = s.block_gradients - s.down_gradients  # the rest of the first layer's share
        grads.append(b.alloc("gradients", made, where, _grain(g and g.block[len(g.down):], made)))
        block_grads = b.resolved({"gradients": s.block_gradients}, {"gradients": _grain(g and g.block, s.block_gradients)})
        for _ in range(layers - 1):
            grads += b.allocs(block_grads, where)
    return kept


def _optimizer_step(b: _Builder, s: _Step, grads: list[int], marks: bool = True, label: str = "",
                    states: dict[str, int] | None = None) -> None:
    """``states``: the optimizer states a flat-partition optimizer makes in this ``step()`` (the
    run's first, ``_lazy_states``), once its fp32 gradient partition exists."""
    _instant(b, s, "optimizer_start", marks, f"{label}optimizer step")
    if s.static.optimizer_gradients != s.static.gradients:
        # ZeRO steps from one flat fp32 partition and frees the 16-bit gradients first; with
        # offload the step runs on the host
        b.free_all(grads, f"{label}optimizer step")
        grads = [b.alloc("gradients", s.static.optimizer_gradients, f"{label}optimizer step", tensors=1)]
    for key, nbytes in (states or {}).items():  # never freed: exp_avg and exp_avg_sq, one flat tensor each
        b.alloc(key, nbytes, f"{label}optimizer step", 2)
    _instant(b, s, "optimizer", marks, f"{label}optimizer step")
    b.free_all(grads, f"{label}zero_grad")


def _eval_pass(b: _Builder, s: _Step) -> None:
    """The eval pass after the step's ``zero_grad`` (``planner.memory.evaluation``): each eval
    moment's parts at its mark (none when the run does not evaluate: only the marks are made)."""
    _instant(b, s, "eval_generate", True, "eval: generate")
    _instant(b, s, "eval", True, "eval: loss forward")


def _lazy_states(s: _Step) -> dict[str, int]:
    """The optimizer states a torch optimizer makes in its first ``step()``, not before (torch/optim/
    adam.py ``_init_group``: "Lazy state initialization", ``state["exp_avg"] = torch.zeros_like(p)``
    and ``exp_avg_sq`` for each parameter; bitsandbytes' ``init_state`` alike). DeepSpeed ZeRO
    makes its partitions' states when the engine is built (stage_1_and_2.py
    ``initialize_optimizer_states``): resident from the start, as are paged states, outside the
    allocator; ZeRO-3's optimizer makes them in its first step too (``ShardingSpec.lazy_states``)."""
    if not s.config.sharding.spec.lazy_states(s.config) or (s.grains is None and not s.config.sharding.spec.flat_optimizer):
        return {}
    return {key: nbytes for key, nbytes in s.static.resident.items() if key == "optimizer_states" and nbytes}


def _first_step(b: _Builder, s: _Step, lazy: dict[str, int], previous: int) -> int:
    """The run's first step, before the one the moments are read from: its forward and backward
    with no optimizer state yet, then ``optimizer.step()`` makes the states, each a tensor of its
    parameter's shape (two a parameter), from what the step's activations left cached, before
    the step's temporaries; ``zero_grad`` frees the gradients. The next step's activations then
    find the cache the states were carved from taken, and the reserve grows by what the real run
    reserves (``torch.cuda.max_memory_reserved`` is the run's largest, not the first step's).
    Returns what a hand-written loop's outputs keep."""
    grads, previous = _micro_step(b, s, grads_exist=False, label="step 1: ", marks=False, previous=previous)
    b.fork()  # plans that differ in the optimizer only part here
    if s.config.sharding.spec.flat_optimizer:  # made inside step(), from the flat fp32 partition
        _optimizer_step(b, s, grads, marks=False, label="step 1: ", states=lazy)
        return previous
    g = s.grains
    # two states a parameter, each of its size: every size twice, in order (the pairs flattened in C, not
    # a generator's step per element: Llama-2-7b has 291 parameter tensors)
    twice = tuple(itertools.chain.from_iterable(zip(g.params, g.params)))
    for key, nbytes in lazy.items():  # never freed
        b.alloc(key, nbytes, "step 1: optimizer step", _grain(twice, nbytes))
    _optimizer_step(b, s, grads, marks=False, label="step 1: ")
    return previous


def step_timeline(*, model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                  abandon: Callable[[list[Event], list[int], int], bool] | None = None,
                  shared: dict | None = None) -> Timeline | None:
    """The allocations and frees of one optimizer step of ``config`` (see the module docstring).

    ``abandon(events, forks, outside_allocator)``: asked once the events up to the last fork point
    are made (the model states, and the run's first step up to its optimizer step where there is
    one; ``forks`` so far, and the bytes ``Timeline.outside_allocator`` will hold); where it says
    yes, None is returned and the rest is not made: for a caller that drops a plan whose allocator
    replay is known to run out in those events (``planner.search.shared_estimate``: plans that
    differ in the optimizer only commonly run out alike in the first step's backward, and the rest
    of each timeline was about half of it). ``shared``: the activations of the timelines made before
    (``_step_parts``), of this model and kernels, for one search (``MemoryMemo.activations``)."""
    s = _step_parts(model, config, kernels, shared)
    dims, mode = dims_of(model, config), mode_of(config)
    # the loss path's tensors are logits-sized: tokens x vocab in fp32 (ForCausalLMLoss upcasts
    # them, transformers/loss/loss_utils.py), in the logits' dtype under a 16-bit loss
    # (``loss_upcast`` False); a fused cross-entropy has no logits tensor
    # the MLP's intermediate tensors are tokens x intermediate_size (LlamaMLP: act_fn(gate_proj(x))
    # * up_proj(x)): 4-8 hidden states each; split into hidden-sized pieces they would be
    # requests of 1-10 MiB on small shapes, each given a 20 MiB kLargeBuffer segment no real one gets
    b = _Builder(unit=dims.tokens * dims.h * mode.compute, logits=dims.tokens * dims.v * (4 if config.loss_upcast else mode.logits)
                 if builds_logits(config) else 0,
                 units={_MLP_LOCALS: dims.tokens * model.intermediate_size * mode.compute})
    # the step's allocated peak: the forward's locals stay under it (``_Builder.locals``)
    b.limit = s.static.resident_bytes + max(map(sum, zip(static_moments(s.sizes), batch_moments(s.batch.sizes()))))
    lazy = _lazy_states(s)
    _model_states(b, s, lazy)
    b.fork()  # plans of one model, method and weights' precision part here
    start = len(b.events)
    # a hand-written loop still holds the previous step's outputs when this step's forward runs
    previous = b.alloc("loop/manual_outputs", s.batch.kept, "outputs of the previous step")
    if lazy:
        previous = _first_step(b, s, lazy, previous)
        start = len(b.events)
    if abandon is not None and abandon(b.events, b.forks, s.static.paged_step):
        return None
    if config.grad_accum > 1:
        grads, previous = _micro_step(b, s, grads_exist=False, label="micro-step 1: ", marks=False, previous=previous)
        last = f"micro-step {config.grad_accum}: "
        _micro_step(b, s, grads_exist=True, label=last, marks=True, previous=previous)
    else:
        grads, _ = _micro_step(b, s, grads_exist=False, label="", marks=True, previous=previous)
    _optimizer_step(b, s, grads)
    _eval_pass(b, s)
    timeline = Timeline(events=tuple(b.events), marks=dict(b.marks), host=s.static.host,
                        outside_allocator=s.static.paged_step, paged=s.static.paged, start=start,
                        fork_tails=tuple(len(b.events) - fork for fork in b.forks))
    # the walk holds at each mark what the moment lists (its transient parts come from the list); read
    # as the builder marked it, not from the timeline's curve: a plan the search drops never needs that
    # curve, and a plan shown gets its own once the workspaces are put first (``device_timeline``)
    if __debug__:
        resident = s.static.resident_bytes
        for moment, fixed, batch in zip(MOMENTS, static_moments(s.sizes), batch_moments(s.batch.sizes())):
            assert b.live_marked[moment.name] == resident + fixed + batch, moment.name
    return timeline


def _model_states(b: _Builder, s: _Step, lazy: dict[str, int]) -> None:
    """The resident model states before the first step (all but ``lazy``): in the order and with
    the temporaries the sharding library builds them (``ShardingSpec.build_sequence``), the rest
    in order, each as the tensors it is (``_resident_tensors``)."""
    model, config, resident = s.model, s.config, s.static.resident
    made: dict[str, int] = _wrap_prelude(b, s) if draws_wrap(model, config) else {}
    for op, key, nbytes, tensors in config.sharding.spec.build_sequence(model, config, trained(model, config), resident):
        if op == "free":
            b.free(made.pop(key), "model states")
            continue
        made[key] = b.alloc(key, nbytes, "model states",
                            tensors=tensors or _resident_tensors(model, config, key, nbytes))
    for key, nbytes in resident.items():
        if key not in lazy and key not in made:
            b.alloc(key, nbytes, "model states", tensors=_resident_tensors(model, config, key, nbytes))


def _wrap_prelude(b: _Builder, s: _Step) -> dict[str, int]:
    """FSDP1 wrapping a host-loaded model on more than one GPU (``planner.memory.wrap``): each unit's
    parameters, broadcast buckets and flat parameter made and freed around its shard of the resident
    weights, drawn as the model states. A temporary that would take the live bytes over the step's
    peak (``_Builder.limit``) is left out, as ``_Builder.locals`` leaves a local out, so no point
    before the step exceeds the moments. Returns the weights' keys made (the ``made`` of
    ``_model_states``)."""
    made: dict[str, int] = {}
    slots: dict[int, tuple[int, int] | None] = {}  # slot -> (event id, bytes), None where left out
    where = "load and wrap"
    live = b.live_bytes()
    for op in wrap_ops(s.model, s.config, s.static.resident):
        if op[0] == "free":
            if (held := slots.pop(op[1])) is not None:
                b.free(held[0], where)
                live -= held[1]
            continue
        _, slot, key, nbytes, tensors = op
        if key in s.static.resident:  # a unit's shard: resident, never freed
            made[key] = b.alloc(key, nbytes, where, tensors)
            slots[slot] = (made[key], nbytes)
        elif live + nbytes <= b.limit:
            slots[slot] = (b.alloc(key, nbytes, where, tensors), nbytes)
        else:
            slots[slot] = None
            continue
        live += nbytes
    return made


#: the weights' breakdown keys (planner/memory/states.py model_state_breakdown)
_WEIGHT_KEYS = frozenset({"weights", "weights/nf4", "weights/unquantized"})


def weight_tensors(model: ModelSpec, key: str) -> tuple[int, ...]:
    """Element counts of the tensors a weights component is, in the model's order: every base
    parameter (``weights``); under QLoRA the module linears' weight matrices bitsandbytes
    quantises (``weights/nf4``: one packed Params4bit each, its quantisation state folded in by
    ``shares``) and the rest (``weights/unquantized``: embeddings, norms, biases, the head, bare
    expert stacks). Cut into equal pieces, as a model-state component was, a norm's few
    kilobytes became a 10 MiB request and the 3.5 GB fp32 embedding of Gemma-2-9B 380 requests of
    9 MiB, each pair given a 20 MiB kLargeBuffer segment (CUDACachingAllocator.cpp
    get_allocation_size): 0.8 GiB reserved that no tensor of the real model makes."""
    base = base_tensor_sizes(model)
    if key == "weights":
        return base
    hit = _WEIGHT_TENSORS.get(model, key)
    return hit if hit is not None else _WEIGHT_TENSORS.put(model, key, _quantized_split(model, key, base))


#: ``weight_tensors``' QLoRA components by model and key: every QLoRA plan shown walks the model's
#: linears again otherwise
_WEIGHT_TENSORS = IdentityMemo(kept=64)


def _quantized_split(model: ModelSpec, key: str, base: tuple[int, ...]) -> tuple[int, ...]:
    """``weight_tensors`` of ``weights/nf4`` or ``weights/unquantized`` (``base``: every base tensor)."""
    quantized = [lin.in_features * lin.out_features for n, linears in model.all_blocks for _ in range(n)
                 for lin in linears if lin.module for _ in range(lin.count)]
    if key == "weights/nf4":
        return tuple(quantized)
    left = Counter(quantized)  # the base tensors less the quantised matrices, in order
    unquantized = []
    for size in base:
        if left[size] > 0:
            left[size] -= 1
        else:
            unquantized.append(size)
    return tuple(unquantized)


def _resident_tensors(model: ModelSpec, config: TrainConfig, key: str, nbytes: int) -> int | tuple[int, ...]:
    """The tensors a model-state component is (the allocator replay's grain): the weights each a
    tensor of its parameter's size (``weight_tensors``), one per trainable tensor for gradients
    and (two per tensor) torch optimizer states; DeepSpeed's flat partitions and buckets are
    single tensors."""
    per_param = model.num_layers * (len(model.layer_linears) + 2) + 3
    trainable = per_param if config.method is Method.FULL else max(1, 2 * model.num_layers * len(lora_targets(model, config)))
    scheme = BREAKDOWN_KEYS.get(key)  # a sharding scheme's buffers: as it declares them
    if scheme is not None and scheme.tensors:
        return scheme.tensors
    if scheme is not None and scheme.tensor_bytes:
        return max(1, nbytes // scheme.tensor_bytes)
    if key in _WEIGHT_KEYS:
        return _grain(weight_tensors(model, key), nbytes) or per_param
    if key == ROPE_CACHES_KEY:  # a cos and a sin table a layer, of one size (memory/buffers.py)
        return max(1, rope_cache_tensors(model, config)[0])
    if key == "optimizer_states":
        return 2 if config.sharding.spec.flat_optimizer else 2 * trainable
    if key == "lora/weights" or (key == "gradients" and config.method is not Method.FULL):
        return trainable
    return per_param
