"""The moments of one optimizer step at which memory can peak, and what lives at each.

A training step goes through seven moments, and the eval pass (when the run evaluates) two more
after them; the peak is the largest:

* ``forward``: static model states + every tensor saved for backward + the logits/loss
  temporaries at the end of the forward pass (the last micro-step of an accumulation, when the
  previous micro-steps' gradients already exist);
* ``backward_start``: the saved tensors are still alive and the loss' backward allocates the
  gradient of the logits (for large vocabularies this is the peak);
* ``first_block_recompute``: the backward of the last block, before it frees anything: under
  checkpointing the end of its recompute, where the forward's locals (the MLP's input, peft's
  fp32 cast of a 16-bit product, an adapter's output sum) are alive beside every saved tensor of
  the block (``activations.recompute_end_terms``; LoRA with fp32 adapters on 16-bit activations
  peaks here);
* ``first_block_backward``: the backward of the last block, the first one backward reaches: the
  head's saved tensors are gone, every block's checkpoint (or saved tensors) is still held, under
  checkpointing the block is recomputed, and its MLP's gradients sit on top
  (``activations.block_backward_terms``; for small vocabularies and long sequences, and for QLoRA's
  fp32 residual stream, this is the peak). Where the sharding scheme's hooks keep each layer's
  checkpoint and input gradient to the end of backward (``retention``: FSDP1 under transformers 4's
  reentrant checkpoint), these two stand at the first layer's backward, which holds the most: every
  checkpoint and the gradients of the layers after it (``BatchTerms.retained``);
* ``backward_end``: most saved tensors are released and every gradient exists (under ``retention``
  every layer's checkpoint and input gradient too: ``BatchTerms.retained_end``);
* ``optimizer_start``: DeepSpeed ZeRO flattens this rank's gradients into an fp32 partition
  (ZeRO-3 after its checks of them: the fp16 overflow test, the norm's float64 copy);
* ``optimizer``: gradients + optimizer states + the optimizer's own temporaries;
* ``eval_generate``, ``eval``: the eval pass after the step (``planner.memory.evaluation``): the
  model states without gradients, and generation's last step or the eval forward at its loss
  (nothing without ``eval_batch``, so these two are never the peak of a run that does not evaluate).

The moments are written once, in ``MOMENTS``: each lists its parts (a breakdown key, the size it
reads, whether that size is static or grows with the micro-batch, and whether it is allocated
for that instant only). The rest is derived from that table: each moment's static and
per-micro-batch sums (``static_moments``, ``batch_moments``: the search's fast path, additive by
construction since every part is on one side), every moment's breakdown (``moment_breakdowns``),
and the timeline's instants (``planner.memory.timeline`` allocates a moment's transient parts at
its mark and checks that the bytes its walk holds there are the moment's).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from operator import sub
from typing import NamedTuple

from planner.config import Loop, Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memory.activations import (
    HEAD_TERMS,
    StepActivations,
    block_backward_terms,
    block_step_activations,
    block_step_pair,
    breakdown_key,
    down_gradient_params,
    head_saves_input,
    kv_cache_block_bytes,
    logits_backward_transient,
    logits_forward_transient,
    manual_loop_logits,
    qlora_as_lora,
    recompute_end_terms,
    step_activations,
)
from planner.memory.dtypes import FP32, DtypeMode, mode_of
from planner.memory.evaluation import eval_parts
from planner.memory.parameters import Trained
from planner.memory.saved import activation_breakdown, recompute_bytes
from planner.memory.shapes import BlockContext, block_context, dims_of
from planner.memory.states import StaticTerms
from planner.modelspec import ModelSpec
from planner.sharding import NONE, ShardingSpec

#: model-level saved tensors the output side keeps, freed by the head's backward before any block's
#: (the lm_head's 16-bit weight cast under autocast among them)
HEAD_SAVED = HEAD_TERMS | {"autocast/weight_casts"}


@dataclass(frozen=True, slots=True)
class Part:
    """One thing alive at a moment of the step."""

    key: str
    """The breakdown key its bytes count under (a ``by_key`` part: the name of its group)."""
    size: str
    """The attribute it reads: of ``StaticSizes`` when ``static``, else of ``BatchSizes`` (its sum)
    and ``BatchTerms`` (by breakdown key when ``by_key``)."""
    static: bool
    """Batch-independent (model states, gradients, optimizer temporaries), else per micro-batch
    and affine in it."""
    transient: bool = False
    """Alive for this instant only: the timeline allocates it just before the moment's mark and
    frees it just after; what is not transient the timeline's walk holds there."""
    by_key: bool = False
    """Several breakdown keys (the saved activations): ``BatchTerms``' attribute is a dict."""
    tensors: int | None = None
    """The allocator replay's grain, when it is not the term's bytes over one activation."""


@dataclass(frozen=True, slots=True)
class Moment:
    name: str
    parts: tuple[Part, ...]

    @property
    def transients(self) -> tuple[Part, ...]:
        return tuple([part for part in self.parts if part.transient])


def _static(key: str, size: str, **how) -> Part:
    return Part(key, size, True, **how)


def _batch(key: str, size: str, **how) -> Part:
    return Part(key, size, False, **how)


#: the breakdown key of what the sharding scheme keeps alive to the end of backward (``retention``)
RETAINED_KEY = "activations/retained_input_gradients"

#: the key of a part the sharding scheme names: ``ShardingSpec.step_key`` of the part's size (ZeRO-3's
#: gathered parameters count under ``zero3/gathered_params``)
SCHEME = "<scheme>"

#: what a hand-written loop's outputs keep (``BatchTerms.kept``): at the end of the forward those of
#: the previous micro-step, which the name releases only when the forward returns, afterwards this
#: one's; alive at every moment
_KEPT = _batch("loop/manual_outputs", "kept")

#: the moments of a step, in the order they happen, and what lives at each beside the resident
#: model states
MOMENTS = (
    # ZeRO-3 holds the running block's gathered parameters (lm_head's at the end of forward);
    # during accumulation the previous micro-steps' gradients exist
    Moment("forward", (
        _batch("activations", "activations", by_key=True),
        _batch("logits/transient", "forward_logits", transient=True),
        _static("gradients", "gradients_forward"),
        _static(SCHEME, "gathered"),
        _static(SCHEME, "held"),
        _batch("kv_cache", "kv_cache"),
        _KEPT)),
    # the loss' backward runs before any checkpointed block is recomputed or any parameter is
    # gathered again: both belong to the rest of backward, after the logits' gradients are freed
    # (measured: ZeRO-3 on one rank holds no gathered parameters here)
    Moment("backward_start", (
        _batch("activations", "activations", by_key=True),
        _batch("logits/transient", "backward_logits", transient=True),
        _static("gradients", "gradients_forward"),
        _static(SCHEME, "held"),
        _KEPT)),
    # the head's gradients are made and its saved tensors freed; the running block's parameters
    # are gathered again under ZeRO-3; the last block is recomputed
    # (``activations.recompute_end_terms``)
    Moment("first_block_recompute", (
        _batch("activations", "after_head", by_key=True),
        _batch("activations/first_block_recompute", "recompute_end", by_key=True, transient=True),
        _batch(RETAINED_KEY, "retained"),
        _static("gradients", "gradients_head"),
        _static(SCHEME, "gathered"),
        _static(SCHEME, "held"),
        _static(SCHEME, "reducing", transient=True),
        _KEPT)),
    # its MLP output projection's backward ran: its saved tensors freed, its gradients made
    # (``activations.block_backward_terms``); under ``retention`` both moments are the first layer's
    # backward, with the input gradients of the layers after it
    Moment("first_block_backward", (
        _batch("activations", "after_head", by_key=True),
        _batch("activations/first_block", "block_backward", by_key=True, transient=True),
        _batch(RETAINED_KEY, "retained"),
        _static("gradients", "gradients_block"),
        _static(SCHEME, "gathered"),
        _static(SCHEME, "held"),
        _static(SCHEME, "reducing", transient=True),
        _KEPT)),
    Moment("backward_end", (
        _batch("activations/recompute", "recompute", transient=True),
        _batch("activations", "retained_end", by_key=True),
        _static("gradients", "gradients"),
        _static(SCHEME, "gathered"),
        _static(SCHEME, "held"),
        _static(SCHEME, "reducing_end", transient=True),
        _static("gradients/tied_embedding_partials", "tied_partials", transient=True),
        _KEPT)),
    # DeepSpeed ZeRO flattens this rank's gradients into an fp32 partition (two buffers), after
    # ZeRO-3's checks of them (``StaticTerms.step_checks``: the timeline draws each, then the flatten)
    Moment("optimizer_start", (
        _static("gradients", "gradients"),
        _static(SCHEME, "gradient_flatten", transient=True, tensors=2),
        _KEPT)),
    Moment("optimizer", (
        _static("gradients", "optimizer_gradients"),
        _static("optimizer_step/transient", "optimizer_step", transient=True),
        _KEPT)),
    # the eval pass after the step's zero_grad (gradients None): generation's last step, then the
    # eval forward at its loss (Seq2SeqTrainer.prediction_step's order); sized by the eval batch,
    # flat in the training micro-batch (``evaluation.eval_parts``)
    Moment("eval_generate", (
        _batch("eval", "eval_generate", by_key=True, transient=True),
        _KEPT)),
    Moment("eval", (
        _batch("eval", "eval_forward", by_key=True, transient=True),
        _KEPT)),
)

#: the moments' names, in the order they happen
PHASES = tuple([moment.name for moment in MOMENTS])
#: each moment by name
MOMENT = {moment.name: moment for moment in MOMENTS}


class StaticSizes(NamedTuple):
    """The batch-independent sizes the moments read (``MOMENTS``' static parts), of one
    configuration on one device. (An immutable named tuple, not a frozen dataclass, as
    ``timeline.Event``: the search makes two per static key, and a frozen dataclass of nine
    fields took 2.3 times as long to make, 13 against 5.7 us on a loaded machine.)"""

    gradients: int
    """Every gradient (``StaticTerms.gradients``)."""
    gradients_forward: int
    """Alive through a micro-step's forward and the loss' backward: the earlier micro-steps' when
    accumulating, else none."""
    gradients_head: int
    """Alive at the last block's recompute: the head's, made by its backward (every one when
    accumulating)."""
    gradients_block: int
    """Alive at the last block's backward: the head's and its MLP output projection's
    (``first_block_gradients``; every one when accumulating)."""
    gathered: int
    """ZeRO-3: the running block's gathered parameters."""
    held: int
    """``StaticTerms.held``: from the forward to the end of backward (FSDP2's root unit)."""
    reducing: int
    """``StaticTerms.reducing``: in the last block's backward (FSDP2's reduce-scatter)."""
    reducing_end: int
    """``StaticTerms.reducing_end``: at the end of backward."""
    tied_partials: int
    """``StaticTerms.tied_gradient_sum``."""
    gradient_flatten: int
    """``StaticTerms.zero_gradient_flatten``, or the largest of ``StaticTerms.step_checks`` when one
    is larger (each is made and freed before the flatten)."""
    optimizer_gradients: int
    """Gradient bytes alive while the optimizer steps."""
    optimizer_step: int
    """Temporaries inside optimizer.step()."""


#: each ``StaticSizes`` field, in its order, as an expression of the static terms ``s`` (``StaticTerms``),
#: whether the micro-step accumulates (``acc``: every gradient exists) and the head's and the last block's
#: MLP output projection's gradients (``head``, ``down``: ``first_block_gradients``); ``static_sizes`` and
#: ``static_parts`` are made from it
_SIZE_OF = {
    "gradients": "s.gradients",
    "gradients_forward": "s.gradients if acc else 0",
    "gradients_head": "s.gradients if acc else head",
    "gradients_block": "s.gradients if acc else head + down",
    "gathered": "s.gathered", "held": "s.held", "reducing": "s.reducing", "reducing_end": "s.reducing_end",
    "tied_partials": "s.tied_gradient_sum",
    # the step's checks come one after the other before the flatten: the largest of them is the moment's
    "gradient_flatten": "max(s.zero_gradient_flatten, *[n for _, n in s.step_checks]) if s.step_checks"
                        " else s.zero_gradient_flatten",
    "optimizer_gradients": "s.optimizer_gradients", "optimizer_step": "s.optimizer_step",
}


def static_sizes(static: StaticTerms, *, accumulating: bool, head_grads: int = 0, down_grads: int = 0) -> StaticSizes:
    """``static``'s sizes as the moments read them (``_SIZE_OF``); ``head_grads`` and ``down_grads``:
    the head's and the last block's MLP output projection's gradients (``first_block_gradients``)."""
    return _SIZES(static, accumulating, head_grads, down_grads)


def _sizer():
    """``lambda s, acc, head, down: StaticSizes(...)`` of ``_SIZE_OF``'s expressions, made by position
    (a named tuple's keyword call parses its keywords in Python: twice as long)."""
    assert tuple(_SIZE_OF) == StaticSizes._fields, tuple(_SIZE_OF)
    return eval(f"lambda s, acc, head, down: _new(StaticSizes, ({', '.join(_SIZE_OF.values())},))",  # noqa: S307
                {"_new": tuple.__new__, "StaticSizes": StaticSizes})


_SIZES = _sizer()


class BatchSizes(NamedTuple):
    """The per-micro-batch sizes the moments read (``MOMENTS``' batch parts), each a sum of
    ``BatchTerms``' attribute of the same name. (A named tuple as ``StaticSizes``: the search
    makes two per batch key.)"""

    activations: int
    after_head: int
    recompute_end: int
    block_backward: int
    recompute: int
    forward_logits: int
    backward_logits: int
    kv_cache: int
    kept: int
    eval_generate: int = 0
    eval_forward: int = 0
    retained: int = 0
    retained_end: int = 0


def _moment_sizes(static: bool) -> list[list[str]]:
    """Each moment's ``static`` (else per-micro-batch) parts' sizes, in ``MOMENTS``' order."""
    out = [[part.size for part in moment.parts if part.static is static] for moment in MOMENTS]
    assert all(size.isidentifier() for sizes in out for size in sizes), out
    return out


def _summer(static: bool):
    """``lambda s: (s.a + s.b, ...)``: each moment's sum of its ``static`` (else per-micro-batch)
    parts' sizes, the code a hand-written sum would be, made once from ``MOMENTS`` (as
    ``collections.namedtuple`` makes its methods). The search sums a thousand moments' lists per
    search, and a loop over getters took ten times as long (3.7 against 35 us a call on a loaded
    machine)."""
    sums = [" + ".join([f"s.{size}" for size in sizes]) or "0" for sizes in _moment_sizes(static)]
    return eval(f"lambda s: ({', '.join(sums)},)", {})  # noqa: S307 (the table's own names)


_STATIC_SUMS, _BATCH_SUMS = _summer(True), _summer(False)


def static_parts(static: StaticTerms, resident: int, head_grads: int,
                 down_grads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per accumulating (False, True), each moment's static part plus ``resident`` (the resident
    states' bytes): ``static_moments`` of ``static_sizes`` (``head_grads``, ``down_grads`` read when
    not accumulating), each plus ``resident``, in one pass (``_parter``). The search makes it for
    each static key (489 an every-precision search of the bench request), where the two sizes and
    their sums took 36 K instructions a key (cachegrind; tests/memory/test_static_parts.py holds the
    two equal)."""
    return _PARTS(static, resident, head_grads, down_grads)


def _parter():
    """``static_parts``' code, made once from ``_SIZE_OF`` and ``MOMENTS``: each field of the static
    terms read once (the named tuple unpacked into locals), each size worked out not accumulating
    (``a_``) and accumulating (``b_``), and each moment's sum of its static sizes on the resident
    states (as ``_summer``'s)."""
    fields = StaticTerms._fields
    lines = ["def parts(s, r, head, down):", f"    {', '.join('s_' + name for name in fields)}, = s"]
    for acc, prefix in ((False, "a_"), (True, "b_")):
        lines.append(f"    acc = {acc}")
        lines += [f"    {prefix}{size} = {_on_locals(expr)}" for size, expr in _SIZE_OF.items()]
    sums = _moment_sizes(True)
    made = ["(" + ", ".join([" + ".join(["r"] + [prefix + size for size in sizes]) for sizes in sums]) + ",)"
            for prefix in ("a_", "b_")]
    lines.append(f"    return {made[0]}, {made[1]}")
    namespace: dict = {}
    exec("\n".join(lines), {}, namespace)  # noqa: S102 (the tables' own names)
    return namespace["parts"]


def _on_locals(expr: str) -> str:
    """``_SIZE_OF``'s expression with each field of ``s`` read from ``_parter``'s local of it."""
    return re.sub(r"\bs\.(\w+)", r"s_\1", expr)


_PARTS = _parter()


def static_moments(sizes: StaticSizes) -> tuple[int, ...]:
    """Each moment's static part, the resident states not included."""
    return _STATIC_SUMS(sizes)


def batch_moments(sizes: BatchSizes) -> tuple[int, ...]:
    """Each moment's per-micro-batch part. A moment's bytes are ``static_moments`` + this (+ the
    resident states): every part is on one side, which the search's fast path relies on."""
    return _BATCH_SUMS(sizes)


@dataclass(frozen=True, slots=True)
class BatchTerms:
    """The per-micro-batch terms of one configuration (each affine in the micro-batch), by
    breakdown key where ``MOMENTS`` reads them so."""

    activations: dict[str, int]
    """Saved for backward over the whole forward pass, by breakdown key."""
    recompute: int
    """Checkpointing: one block's saved tensors rebuilt in backward."""
    forward_logits: int
    """The logits and their fp32 upcast at the loss."""
    backward_logits: int
    """The loss' backward: two fp32 tensors of the logits' size."""
    kv_cache: int = 0
    """The KV cache this forward builds (``TrainConfig.builds_kv_cache``), every layer's."""
    kept: int = 0
    """What a hand-written loop's ``outputs`` keeps past the loss (its logits and KV cache) until
    the next forward returns; 0 with the HF Trainer, whose compute_loss drops the outputs."""
    head: dict[str, int] = field(default_factory=dict)
    """The head's saved tensors (``HEAD_SAVED``; an encoder-decoder's decoder head), by breakdown
    key: freed by its backward, before any block's."""
    after_head: dict[str, int] = field(default_factory=dict)
    """The saved tensors left once the head's backward ran (``activations`` less ``head``)."""
    block_backward: dict[str, int] = field(default_factory=dict)
    """What the last block's backward adds to them at its MLP output projection's backward
    (``activations.block_backward_terms``), by breakdown key."""
    recompute_end: dict[str, int] = field(default_factory=dict)
    """What it adds before that backward frees anything (``activations.recompute_end_terms``),
    by breakdown key."""
    eval_generate: dict[str, int] = field(default_factory=dict)
    """The eval pass's generation at its last step, by breakdown key (``evaluation.eval_parts``)."""
    eval_forward: dict[str, int] = field(default_factory=dict)
    """The eval forward at its loss, by breakdown key (``evaluation.eval_parts``)."""
    retained: int = 0
    """What the sharding scheme's hooks hold at the first layer's backward (``retention``): the
    input gradients of every layer after it (its own incoming one among them, which
    ``block_backward`` and ``recompute_end`` then leave out)."""
    retained_end: dict[str, int] = field(default_factory=dict)
    """What they hold at the end of backward, by breakdown key: every layer's checkpoint and its
    input gradient (``retention``)."""

    def sizes(self) -> BatchSizes:
        return BatchSizes(
            activations=sum(self.activations.values()), after_head=sum(self.after_head.values()),
            recompute_end=sum(self.recompute_end.values()), block_backward=sum(self.block_backward.values()),
            recompute=self.recompute, forward_logits=self.forward_logits, backward_logits=self.backward_logits,
            kv_cache=self.kv_cache, kept=self.kept, eval_generate=sum(self.eval_generate.values()),
            eval_forward=sum(self.eval_forward.values()), retained=self.retained,
            retained_end=sum(self.retained_end.values()))


def batch_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                targets: frozenset[str] | None = None) -> BatchTerms:
    """``targets``: the adapted linears' names, when the caller has them already."""
    dims, mode = dims_of(model, config), mode_of(config)
    fwd_logits, bwd_logits, cache, kept = _output_terms(model, config, dims, mode, kernels)
    if model.is_encoder_decoder:
        # the decoder's head: its final norm and dropout too (``encdec.timeline_parts``)
        from planner.memory.encdec import timeline_parts

        activations = activation_breakdown(model, config, kernels=kernels, targets=targets)
        recompute = recompute_bytes(model, config, kernels, targets)
        head = timeline_parts(model, config, kernels, targets)[2]
        block_added = block_backward_terms(model, config, kernels, targets)
        end_added = recompute_end_terms(model, config, kernels, targets)
    else:
        # one pass over the block serves the saved tensors, the recompute and both moments of the
        # last block's backward
        step = step_activations(model, config, kernels, targets, dims, mode)
        activations, recompute = step.saved(), step.recompute
        head = {breakdown_key(term): nbytes for term, nbytes in step.level.items() if term in HEAD_SAVED and nbytes}
        block_added, end_added = step.block_backward, step.recompute_end
    after_head = dict(activations)
    for key, nbytes in head.items():
        after_head[key] -= nbytes
    evaluated, generated = eval_parts(model, config, kernels, targets)
    block_backward, recompute_end = _keyed(block_added), _keyed(end_added)
    per = retention(model, config)
    retained, retained_end = 0, {}
    if per:
        block_backward, recompute_end = _incoming_retained(block_backward, per), _incoming_retained(recompute_end, per)
        layers = model.num_layers
        retained = (layers - 1) * per
        retained_end = {_CHECKPOINTS: activations.get(_CHECKPOINTS, 0), RETAINED_KEY: layers * per}
    return BatchTerms(
        activations=activations, recompute=recompute, forward_logits=fwd_logits, backward_logits=bwd_logits,
        kv_cache=cache, kept=kept, head=head, after_head={k: v for k, v in after_head.items() if v},
        block_backward=block_backward, recompute_end=recompute_end,
        eval_generate=generated, eval_forward=evaluated, retained=retained, retained_end=retained_end,
    )


#: the checkpoints' breakdown key (``activations.decoder_activation_breakdown`` under checkpointing)
_CHECKPOINTS = "activations/checkpoints"
#: the key of the gradients the last block's backward holds, its output's among them
#: (``activations.block_backward_terms``, ``recompute_end_terms``: term ``block_backward``)
BLOCK_GRADIENTS = "activations/block_backward"


def retention(model: ModelSpec, config: TrainConfig) -> int:
    """Bytes of one layer-input gradient the sharding scheme's hooks keep alive to the end of
    backward (``ShardingSpec.retained_in_backward``: FSDP1's frozen layers under transformers 4's
    reentrant checkpoint, which gives the (layers - 2) of them the first layer's backward holds
    beyond one process), or 0. What the hooks keep is a layer's detached checkpoint input and its
    ``.grad`` (planner/sharding/fsdp1.py ``retained_input_gradients``), so backward makes them one
    layer at a time: each layer's backward leaves its input gradient, and its checkpoint stays
    (``timeline._retained_backward`` draws them so). The first layer's backward holds those of the
    layers after it, the one it received among them: ``block_backward`` and ``recompute_end`` (a
    block's incoming gradient) leave that one out, and the moments of the last block's backward
    stand there (their sums are the one process' and the (layers - 2) gradients beyond it). At the
    end of backward, before FSDP1's ``_finalize_params`` releases the hooks, every layer's
    checkpoint and input gradient is alive: on the CPU (the test's frozen stack, FSDP1 on one gloo
    rank, reentrant checkpoint) at the last gradient backward makes, (layers - 1) input-sized
    checkpoints and (layers - 1) gradients over one process, which holds the first layer's input
    and its gradient too (4 layers: 6 MiB of 1 MiB tensors, 6 layers: 10 MiB; all freed once
    ``backward()`` returns). Encoder-decoder stacks are not modelled (0): the scheme counts one
    stack's layers."""
    if not config.reentrant_ckpt or model.is_encoder_decoder:
        return 0
    return config.sharding.spec.retained_in_backward(model, config, residual_bytes=mode_of(config).residual)


def _incoming_retained(terms: dict[str, int], per: int) -> dict[str, int]:
    """``terms`` of the last block's backward less its incoming gradient, which the layer after
    it left (``retention``): one retained gradient, counted there."""
    out = dict(terms)
    out[BLOCK_GRADIENTS] = out.get(BLOCK_GRADIENTS, 0) - min(per, out.get(BLOCK_GRADIENTS, 0))
    return {key: nbytes for key, nbytes in out.items() if nbytes}


def _keyed(terms: dict[str, int]) -> dict[str, int]:
    """Activation terms by breakdown key, zero ones dropped."""
    return {breakdown_key(term): nbytes for term, nbytes in terms.items() if nbytes}


#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and each batch line reads it twice
_MANUAL = Loop.MANUAL


def _output_terms(model: ModelSpec, config: TrainConfig, dims, mode,
                  kernels: KernelProfile) -> tuple[int, int, int, int]:
    """(``BatchTerms``' forward_logits, backward_logits, kv_cache, kept)."""
    cache = model.num_layers * kv_cache_block_bytes(model, config, dims, mode)
    kept = manual_loop_logits(dims, mode, config) + cache if config.loop is _MANUAL else 0
    chunks = config.loss_chunks  # a chunked cross-entropy upcasts one piece at a time
    upcast = config.loss_upcast  # or none at all (litgpt's bf16 loss)
    return (logits_forward_transient(dims, mode, config, kernels, chunks=chunks, upcast=upcast),
            logits_backward_transient(dims, mode, config, chunks=chunks, upcast=upcast), cache, kept)


def batch_totals(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                 targets: frozenset[str] | None = None) -> tuple[int, ...]:
    """Each moment's per-micro-batch part, ``batch_moments`` of ``batch_terms``' sizes, from the
    terms' sums: the search's memo reads nothing else, and keying the breakdowns was half of
    ``batch_terms`` (tests/search/test_search_screen.py checks the two agree)."""
    if model.is_encoder_decoder:
        return batch_moments(batch_terms(model, config, kernels, targets).sizes())
    return _decoder_totals(model, config, block_context(model, config, kernels, first=False, targets=targets))


def batch_line(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
               targets: frozenset[str] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each moment's per-micro-batch part at micro-batch 1 and its increase per sample, exactly
    ``batch_totals`` at micro-batch 1 and (that at 2) - (that at 1), ``config``'s accumulation
    kept (the search's memo: every term is affine in the micro-batch). A decoder-only model's two
    evaluations share a later block's context, which reads no size (``BlockContext.at``);
    tests/memory/test_batch_line.py holds this equal to the two calls."""
    one = config.with_split(micro_batch=1, grad_accum=config.grad_accum)
    two = config.with_split(micro_batch=2, grad_accum=config.grad_accum)
    if model.is_encoder_decoder:
        at_one, at_two = batch_totals(model, one, kernels, targets), batch_totals(model, two, kernels, targets)
    else:
        ctx = block_context(model, one, kernels, first=False, targets=targets)
        at_one = _decoder_totals(model, one, ctx)
        at_two = _decoder_totals(model, two, ctx.at(two, dims_of(model, two)))
    return at_one, tuple(map(sub, at_two, at_one))


#: bound once (``_MANUAL``'s note): the search's keys read them for every combination
_FULL, _LORA, _QLORA = Method.FULL, Method.LORA, Method.QLORA


def line_reads(config: TrainConfig) -> tuple:
    """What ``batch_line`` reads of the method, the precision and the sharding, and nothing more: the
    search's batch key holds it beside the fields declared ``BATCH`` (``planner.request.DERIVED``), so
    configurations whose lines are equal share one. The dtype mode (``mode_of``), of which full
    fine-tuning reads nothing of the adapters' (``DtypeMode.adapter``, ``adapter_weight``: read per
    adapted linear, and it adapts none); the method, QLoRA as LoRA where its terms are LoRA's
    (``qlora_as_lora``); whether the output head saves its input (``head_saves_input``: the
    sharding's linears matter only where the head's weight is frozen). The bench request's 156 batch
    lines (every precision) hold 118 values: 32 QLoRA lines their LoRA twins', 6 full fine-tuning
    lines under ZeRO-3 or DeepSpeed's 16-bit model those without. (tests/memory/test_line_reads.py
    holds configurations of one key to equal lines, over every model family.)"""
    mode, method = mode_of(config), config.method
    if method is _FULL:
        mode = _full_mode(mode)
    elif method is _QLORA and qlora_as_lora(mode):
        method = _LORA
    if config.reentrant_ckpt:  # what it keeps depends on the scheme (``retention``), not on the batch key's fields
        return method, mode, head_saves_input(config), config.sharding.spec.name
    return method, mode, head_saves_input(config)


@functools.cache
def _full_mode(mode: DtypeMode) -> DtypeMode:
    """``mode`` as full fine-tuning's terms read it: the adapters' dtypes as peft's (fp32)."""
    return dataclasses.replace(mode, adapter=FP32, adapter_weight=FP32)


def batch_line_pair(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                    targets: frozenset[str] | None = None) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """(``batch_line`` of ``config``, which does not checkpoint, ``batch_line`` of it with
    checkpointing): the search's memo asks for both of every slot. A decoder-only model's two share,
    at each micro-batch, a later block's terms and what its MLP's output projection saves
    (``activations.block_step_pair``); tests/memory/test_batch_line.py holds this equal to the two
    ``batch_line`` calls."""
    assert not config.grad_ckpt, config.label()
    if model.is_encoder_decoder:
        ckpt = config.with_split(micro_batch=config.micro_batch, grad_accum=config.grad_accum, grad_ckpt=True)
        return batch_line(model, config, kernels, targets), batch_line(model, ckpt, kernels, targets)
    totals, ctx = [], None
    for micro in (1, 2):
        without = config.with_split(micro_batch=micro, grad_accum=config.grad_accum)
        with_ckpt = without.with_split(micro_batch=micro, grad_accum=config.grad_accum, grad_ckpt=True)
        if ctx is None:
            ctx = block_context(model, without, kernels, first=False, targets=targets)
        else:
            ctx = ctx.at(without, dims_of(model, without))
        ckpt_ctx = ctx.at(with_ckpt, ctx.dims)
        steps = block_step_pair(ctx, ckpt_ctx)
        totals.append((_decoder_totals(model, without, ctx, steps[0]),
                       _decoder_totals(model, with_ckpt, ckpt_ctx, steps[1])))
    (one, one_ckpt), (two, two_ckpt) = totals
    return (one, tuple(map(sub, two, one))), (one_ckpt, tuple(map(sub, two_ckpt, one_ckpt)))


def _decoder_totals(model: ModelSpec, config: TrainConfig, ctx: BlockContext,
                    step: StepActivations | None = None) -> tuple[int, ...]:
    """``batch_totals`` of a decoder-only model, from a later block's context ``ctx`` (and its
    ``block_step_activations``, where the caller has them)."""
    dims, mode = ctx.dims, ctx.mode
    fwd_logits, bwd_logits, cache, kept = _output_terms(model, config, dims, mode, ctx.kernels)
    step = step or block_step_activations(ctx)
    saved = step.saved_bytes()
    per = retention(model, config) if config.reentrant_ckpt else 0
    eval_forward = eval_generate = 0
    if config.evaluates:
        evaluated, generated = eval_parts(model, config, ctx.kernels, ctx.targets)
        eval_forward, eval_generate = sum(evaluated.values()), sum(generated.values())
    # by position, in the fields' order (``static_sizes``' note: the search makes two per batch line)
    return _BATCH_SUMS(BatchSizes(
        saved,  # activations
        saved - sum([nbytes for term, nbytes in step.level.items() if term in HEAD_SAVED]),  # after_head
        sum(step.recompute_end.values()) - min(per, step.recompute_end.get("block_backward", 0)),  # recompute_end
        sum(step.block_backward.values()) - min(per, step.block_backward.get("block_backward", 0)),  # block_backward
        step.recompute, fwd_logits, bwd_logits, cache, kept, eval_generate, eval_forward,
        (model.num_layers - 1) * per,  # retained
        (step.layers * step.checkpoint + model.num_layers * per) if per else 0))  # retained_end


def first_block_gradients(model: ModelSpec, config: TrainConfig, gradients: int, t: Trained,
                          params: tuple[int, int] | None = None) -> tuple[int, int]:
    """(the head's, the MLP output projection's) shares of ``gradients`` (in proportion to their
    trainable elements, as the timeline shares them out): what exists at the first block's
    backward besides earlier micro-steps' gradients. Full fine-tuning: the head's backward has
    made the lm_head's and the final norm's (a tied head's partial, vocab x hidden, waits in the
    embedding's input buffer); then the output projection's backward makes its own. ``params``:
    ``first_block_params``, when the caller has them (the search's memo, per adapter set)."""
    if not t.count:
        return 0, 0
    head, down = params or first_block_params(model, config, t)
    return gradients * head // t.count, gradients * down // t.count


def first_block_params(model: ModelSpec, config: TrainConfig, t: Trained) -> tuple[int, int]:
    """(the head's, the MLP output projection's) trainable elements (``first_block_gradients``):
    they depend on what trains only, not on the precision, optimizer or ZeRO stage."""
    head = 0
    if config.method is Method.FULL:
        head = model.head_params + model.final_norm_params + (model.lm_head_params if model.tied_embeddings else 0)
    return head, down_gradient_params(model, config, t.target_names)


def part_value(part: Part, static: StaticSizes, batch: BatchTerms) -> int | dict[str, int]:
    """What ``part`` reads: bytes, or bytes by breakdown key for a ``by_key`` part."""
    return getattr(static if part.static else batch, part.size)


def part_key(part: Part, scheme: ShardingSpec) -> str:
    """The breakdown key ``part`` counts under with the sharding ``scheme`` (a ``SCHEME`` part's is
    the scheme's)."""
    return scheme.step_key(part.size) if part.key == SCHEME else part.key


def moment_breakdowns(resident: dict[str, int], static: StaticSizes, batch: BatchTerms,
                      scheme: ShardingSpec = NONE.spec) -> dict[str, dict[str, int]]:
    """Every moment's live bytes by breakdown key, the ``resident`` model states included (zero
    terms dropped), ``scheme`` naming its parts: what the timeline holds at each mark
    (tests/memory/test_timeline.py)."""
    out = {}
    for moment in MOMENTS:
        live = dict(resident)
        for part in moment.parts:
            value = part_value(part, static, batch)
            for key, nbytes in value.items() if part.by_key else ((part_key(part, scheme), value),):
                live[key] = live.get(key, 0) + nbytes
        out[moment.name] = {k: int(v) for k, v in live.items() if v}
    return out


__all__ = [
    "BLOCK_GRADIENTS",
    "HEAD_SAVED",
    "MOMENT",
    "MOMENTS",
    "PHASES",
    "BatchSizes",
    "BatchTerms",
    "Moment",
    "Part",
    "SCHEME",
    "StaticSizes",
    "batch_line",
    "batch_line_pair",
    "batch_moments",
    "batch_terms",
    "batch_totals",
    "first_block_gradients",
    "first_block_params",
    "line_reads",
    "moment_breakdowns",
    "part_key",
    "part_value",
    "static_moments",
    "static_parts",
    "static_sizes",
]
