"""The moments of one optimizer step at which memory can peak, and what lives at each.

A training step goes through seven moments, and the peak is the largest:

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
  fp32 residual stream, this is the peak);
* ``backward_end``: most saved tensors are released and every gradient exists;
* ``optimizer_start``: DeepSpeed ZeRO-1/2 flattens this rank's gradients into an fp32 partition;
* ``optimizer``: gradients + optimizer states + the optimizer's own temporaries.

``planner.memory.timeline`` lists the allocations and frees between these moments; the
moments' totals are sums of a few terms each, affine in the micro-batch, which is what the
search's fast path evaluates (``planner.search``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import sub

from planner.config import Loop, Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memory.activations import (
    HEAD_TERMS,
    block_backward_terms,
    block_step_activations,
    breakdown_key,
    down_gradient_params,
    kv_cache_block_bytes,
    logits_backward_transient,
    logits_forward_transient,
    manual_loop_logits,
    recompute_end_terms,
    step_activations,
)
from planner.memory.dtypes import mode_of
from planner.memory.parameters import Trained
from planner.memory.saved import activation_breakdown, recompute_bytes
from planner.memory.shapes import BlockContext, block_context, dims_of
from planner.memory.states import StaticTerms
from planner.modelspec import ModelSpec

#: the moments of a step, in the order they happen
PHASES = ("forward", "backward_start", "first_block_recompute", "first_block_backward", "backward_end", "optimizer_start", "optimizer")

#: model-level saved tensors the output side keeps, freed by the head's backward before any block's
#: (the lm_head's 16-bit weight cast under autocast among them)
HEAD_SAVED = HEAD_TERMS | {"autocast/weight_casts"}


@dataclass(frozen=True)
class BatchTerms:
    """The per-micro-batch terms of one configuration (each affine in the micro-batch)."""

    activations: dict[str, int]
    """Saved for backward over the whole forward pass, by breakdown key."""
    recompute: int
    """Checkpointing: one block's saved tensors rebuilt in backward."""
    forward_logits: int
    """The logits and their fp32 upcast at the loss."""
    backward_logits: int
    """The loss' backward: two fp32 tensors of the logits' size."""
    kv_cache: int = 0
    """The KV cache this forward builds (``use_cache`` without checkpointing), every layer's."""
    kept: int = 0
    """What a hand-written loop's ``outputs`` keeps past the loss (its logits and KV cache) until
    the next forward returns; 0 with the HF Trainer, whose compute_loss drops the outputs."""
    block_backward: dict[str, int] = field(default_factory=dict)
    """Activations live at the first block's backward, by breakdown key: the saved tensors less
    the head's, plus ``activations.block_backward_terms``."""
    recompute_end: dict[str, int] = field(default_factory=dict)
    """Activations live before that backward frees anything, by breakdown key: the saved tensors
    less the head's, plus ``activations.recompute_end_terms``."""

    @property
    def saved(self) -> int:
        return sum(self.activations.values())

    @property
    def block_live(self) -> int:
        return sum(self.block_backward.values())

    @property
    def recompute_live(self) -> int:
        return sum(self.recompute_end.values())


def batch_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                targets: frozenset[str] | None = None) -> BatchTerms:
    """``targets``: the adapted linears' names, when the caller has them already."""
    dims, mode = dims_of(model, config), mode_of(config)
    fwd_logits, bwd_logits, cache, kept = _output_terms(model, config, dims, mode)
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
    return BatchTerms(
        activations=activations, recompute=recompute, forward_logits=fwd_logits, backward_logits=bwd_logits,
        kv_cache=cache, kept=kept,
        block_backward=_block_backward(activations, head, block_added),
        recompute_end=_block_backward(activations, head, end_added),
    )


def _output_terms(model: ModelSpec, config: TrainConfig, dims, mode) -> tuple[int, int, int, int]:
    """(``BatchTerms``' forward_logits, backward_logits, kv_cache, kept)."""
    cache = model.num_layers * kv_cache_block_bytes(model, config, dims, mode)
    kept = manual_loop_logits(dims, mode, config) + cache if config.loop is Loop.MANUAL else 0
    return logits_forward_transient(dims, mode, config), logits_backward_transient(dims, mode, config), cache, kept


def batch_totals(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
                 targets: frozenset[str] | None = None) -> tuple[int, ...]:
    """Each moment's per-micro-batch part, ``phase_totals(static=NO_STATIC, ...)`` of
    ``batch_terms``, from the terms' sums: the search's memo reads nothing else, and keying and
    merging the breakdowns was half of ``batch_terms`` (tests/test_search_screen.py checks the
    two agree). The first block's live activations are the saved ones less the head's plus what
    its backward adds (``_block_backward``): sums of sums."""
    if model.is_encoder_decoder:
        return batch_phase_totals(batch_terms(model, config, kernels, targets))
    return _decoder_totals(model, config, block_context(model, config, kernels, first=False, targets=targets))


def batch_line(model: ModelSpec, config: TrainConfig, kernels: KernelProfile,
               targets: frozenset[str] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each moment's per-micro-batch part at micro-batch 1 and its increase per sample, exactly
    ``batch_totals`` at micro-batch 1 and (that at 2) - (that at 1), ``config``'s accumulation
    kept (the search's memo: every term is affine in the micro-batch). A decoder-only model's two
    evaluations share a later block's context, which reads no size (``BlockContext.at``);
    tests/test_batch_line.py holds this equal to the two calls."""
    one, two = (config.with_split(micro_batch=b, grad_accum=config.grad_accum) for b in (1, 2))
    if model.is_encoder_decoder:
        at_one, at_two = batch_totals(model, one, kernels, targets), batch_totals(model, two, kernels, targets)
    else:
        ctx = block_context(model, one, kernels, first=False, targets=targets)
        at_one = _decoder_totals(model, one, ctx)
        at_two = _decoder_totals(model, two, ctx.at(two, dims_of(model, two)))
    return at_one, tuple(map(sub, at_two, at_one))


def _decoder_totals(model: ModelSpec, config: TrainConfig, ctx: BlockContext) -> tuple[int, ...]:
    """``batch_totals`` of a decoder-only model, from a later block's context ``ctx``."""
    dims, mode = ctx.dims, ctx.mode
    fwd_logits, bwd_logits, cache, kept = _output_terms(model, config, dims, mode)
    step = block_step_activations(ctx)
    saved = step.saved_bytes()
    live = saved - sum([nbytes for term, nbytes in step.level.items() if term in HEAD_SAVED])
    return phase_totals(static=NO_STATIC, saved=saved, recompute=step.recompute, fwd_logits=fwd_logits,
                        bwd_logits=bwd_logits, accumulating=False, cache=cache, kept=kept,
                        block_live=live + sum(step.block_backward.values()),
                        recompute_live=live + sum(step.recompute_end.values()))


def batch_phase_totals(terms: BatchTerms) -> tuple[int, ...]:
    """``phase_totals(static=NO_STATIC, ...)`` of ``terms``: the part of each moment a micro-batch adds."""
    return phase_totals(static=NO_STATIC, saved=terms.saved, recompute=terms.recompute,
                        fwd_logits=terms.forward_logits, bwd_logits=terms.backward_logits, accumulating=False,
                        cache=terms.kv_cache, kept=terms.kept, block_live=terms.block_live,
                        recompute_live=terms.recompute_live)


def _block_backward(activations: dict[str, int], head: dict[str, int], added: dict[str, int]) -> dict[str, int]:
    """The saved tensors (``activations``) less the head's (``head``, by breakdown key: the
    ``HEAD_SAVED`` terms, an encoder-decoder's decoder head), plus what the first block's backward
    adds at one of its instants (``added``, by term: ``block_backward_terms`` or
    ``recompute_end_terms``)."""
    live = dict(activations)
    for key, nbytes in head.items():
        live[key] -= nbytes
    for term, nbytes in added.items():
        key = breakdown_key(term)
        live[key] = live.get(key, 0) + nbytes
    return {k: v for k, v in live.items() if v}


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


def phases(*, static: StaticTerms, saved: int, recompute: int, fwd_logits: int, bwd_logits: int,
           accumulating: bool, cache: int = 0, kept: int = 0, block_live: int = 0,
           block_grads: int = 0, recompute_live: int = 0, head_grads: int = 0) -> dict[str, dict[str, int]]:
    """What lives beside the resident model states at each moment of a step, by breakdown
    component ("activations" stands for every saved-activation term). During accumulation the
    previous micro-steps' gradients exist in the forward. ``cache``: the KV cache the forward
    builds; ``kept``: what a hand-written loop's outputs keep (``BatchTerms``), at the end of the
    forward those of the previous micro-step, which the name releases only when the forward
    returns, afterwards this one's. ``block_live``: the activations live at the first block's
    backward (``BatchTerms.block_backward``, listed as "activations/first_block"); ``block_grads``:
    the gradients made by then (``first_block_gradients``), unless earlier micro-steps' exist;
    ``recompute_live``: the activations live before that backward frees anything
    (``BatchTerms.recompute_end``, listed as "activations/first_block_recompute"), when only the
    head's gradients (``head_grads``) are made."""
    grads_fwd = static.gradients if accumulating else 0
    loop = {"loop/manual_outputs": kept}
    return {
        # ZeRO-3 holds the running block's gathered parameters (lm_head's at the end of forward)
        "forward": {"activations": saved, "logits/transient": fwd_logits, "gradients": grads_fwd,
                    "zero3/gathered_params": static.gathered, "kv_cache": cache, **loop},
        # the loss' backward runs before any checkpointed block is recomputed or any parameter
        # is gathered again: both belong to the rest of backward, after the logits' gradients
        # are freed (measured: ZeRO-3 on one rank holds no gathered parameters here)
        "backward_start": {"activations": saved, "logits/transient": bwd_logits, "gradients": grads_fwd, **loop},
        # the head's gradients are made and its saved tensors freed; the running block's
        # parameters are gathered again under ZeRO-3; the last block is recomputed
        "first_block_recompute": {"activations/first_block_recompute": recompute_live,
                                  "gradients": static.gradients if accumulating else head_grads,
                                  "zero3/gathered_params": static.gathered, **loop},
        # its MLP output projection's backward ran: its saved tensors freed, its gradients made
        "first_block_backward": {"activations/first_block": block_live,
                                 "gradients": static.gradients if accumulating else block_grads,
                                 "zero3/gathered_params": static.gathered, **loop},
        "backward_end": {"activations/recompute": recompute, "gradients": static.gradients,
                         "zero3/gathered_params": static.gathered,
                         "gradients/tied_embedding_partials": static.tied_gradient_sum, **loop},
        "optimizer_start": {"gradients": static.gradients, "zero/gradient_flatten": static.zero_gradient_flatten, **loop},
        "optimizer": {"gradients": static.optimizer_gradients, "optimizer_step/transient": static.optimizer_step, **loop},
    }


#: no model states: ``phase_totals(NO_STATIC, ...)`` is the part of each moment a micro-batch adds
NO_STATIC = StaticTerms(resident={}, gradients=0, gathered=0, paged=0, host=0, optimizer_step=0, optimizer_gradients=0)


def phase_totals(*, static: StaticTerms, saved: int, recompute: int, fwd_logits: int, bwd_logits: int,
                 accumulating: bool, cache: int = 0, kept: int = 0, block_live: int = 0,
                 block_grads: int = 0, recompute_live: int = 0, head_grads: int = 0) -> tuple[int, ...]:
    """The bytes ``phases`` lists at each moment (resident states not included), as plain sums:
    the search's memo makes thousands of these, and building ``phases``' dicts to add them up
    took a quarter of a search (tests/test_timeline.py checks the two agree term by term). Every
    moment is a sum of static and per-micro-batch terms, so the totals are additive:
    totals(static, batch) = totals(static, no batch) + totals(NO_STATIC, batch), which the
    search's fast path uses (``block_grads`` and ``head_grads`` are static terms, ``block_live`` and
    ``recompute_live`` per-micro-batch ones)."""
    grads_fwd = static.gradients if accumulating else 0
    return (
        saved + fwd_logits + grads_fwd + static.gathered + cache + kept,
        saved + bwd_logits + grads_fwd + kept,
        recompute_live + (static.gradients if accumulating else head_grads) + static.gathered + kept,
        block_live + (static.gradients if accumulating else block_grads) + static.gathered + kept,
        recompute + static.gradients + static.gathered + static.tied_gradient_sum + kept,
        static.gradients + static.zero_gradient_flatten + kept,
        static.optimizer_gradients + static.optimizer_step + kept,
    )


def phase_breakdowns(static: StaticTerms, batch: BatchTerms, *, accumulating: bool,
                     block_grads: int = 0, head_grads: int = 0) -> dict[str, dict[str, int]]:
    """Every moment's live bytes by breakdown key, resident states included (zero terms dropped)."""
    out = {}
    for name, parts in phases(static=static, saved=batch.saved, recompute=batch.recompute,
                              fwd_logits=batch.forward_logits, bwd_logits=batch.backward_logits,
                              accumulating=accumulating, cache=batch.kv_cache, kept=batch.kept,
                              block_live=batch.block_live, block_grads=block_grads,
                              recompute_live=batch.recompute_live, head_grads=head_grads).items():
        breakdown = dict(static.resident)
        for component, size in parts.items():
            if component == "activations":
                breakdown.update(batch.activations)
            elif component == "activations/first_block":
                breakdown.update(batch.block_backward)
            elif component == "activations/first_block_recompute":
                breakdown.update(batch.recompute_end)
            else:
                breakdown[component] = size
        out[name] = {k: int(v) for k, v in breakdown.items() if v}
    return out


__all__ = [
    "HEAD_SAVED",
    "NO_STATIC",
    "PHASES",
    "BatchTerms",
    "batch_line",
    "batch_phase_totals",
    "batch_terms",
    "batch_totals",
    "first_block_gradients",
    "first_block_params",
    "phase_breakdowns",
    "phase_totals",
    "phases",
]
