"""Which host time FSDP1's rate limiter exposes: a bounded-lead host/device timeline of a decoder
layer's passes under ``limit_all_gathers`` with peft's adapter units (pure: no torch).

The mechanism (torch 2.4.1, the fms runs'; the same lines in 2.13, cited from 2.13's
``torch/distributed/fsdp/``):

* every unit's unshard, before its all-gather, pops the oldest free event once two are queued and
  waits on the CPU until the GPU has passed it (_runtime_utils.py l.297-303 ``_unshard``:
  ``state._free_event_queue.dequeue_if_needed()`` then ``event.synchronize()``; _limiter_utils.py
  l.15 ``_max_num_inflight_all_gathers = 2``, l.21-25 ``dequeue_if_needed``);
* every reshard that frees records an event on the compute stream and queues it (l.310-326
  ``_reshard``): a forward's post-forward (l.486-500) and a backward's post-backward;
* one queue for the whole model: the root hands its own to every unit (l.223
  ``fsdp_state._free_event_queue = root_state._free_event_queue``), so a tiny adapter unit waits
  for the free two frees back, whichever unit made it;
* backward prefetch (BACKWARD_PRE, accelerate's default) unshards, in each unit's pre-backward, the
  unit before it in post-forward order (l.693 ``_prefetch_handle``; _exec_order_utils.py l.88-107
  ``get_handle_to_backward_prefetch``: ``_post_forward_index - 1``), a unit whose recomputed
  forward set ``_needs_pre_backward_unshard`` (l.1397-1410; a reentrant checkpoint's first forward
  runs without gradients and sets none, l.1391).

So the host may run at most two frees ahead of the device. Where the kernels queued behind the
awaited free are short (a GQA model's k_proj and v_proj GEMMs against two adapter units' hooks), the
device drains, and the host work after the wait, up to the next long kernel's launch, runs with
the device idle: that share, and only it, of each base projection's own host time (bitsandbytes'
``Linear4bit`` Python) reaches the step. ``exposed_seconds`` times it; planner/sharding/fsdp1.py
prices what it finds there (``linear4bit_exposed_seconds``), over the ``Layer`` the throughput model
builds from its device rates (``planner.throughput.fsdp1_decoder_layer``).

Modelled: the device's compute stream as one queue (each kernel starts when both the host has
launched it and the previous one has finished); all-gathers and reduce-scatters off it (their bytes
are the step's comm part; a unit's all-gather of a few adapter rows takes microseconds); host time
in blocks, each launched at its end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Frees the rate limiter lets run ahead (torch fsdp/_limiter_utils.py l.15).
MAX_INFLIGHT_ALL_GATHERS = 2

#: Host ops of the layer's items, each at ``planner.kernels.host_op_seconds`` (the counts of
#: ``planner.kernels.OPS_PER_BLOCK``'s and ``OPS_PER_ADAPTER``'s notes): an RMSNorm 6, rotary and attention 13,
#: one adapter unit's half of its module's 5 forward ops (identity dropout, A, B, scale, add).
NORM_OPS, ATTENTION_OPS, ADAPTER_UNIT_OPS = 6, 13, 2.5
#: Passes over a 16-bit (tokens x hidden) tensor of a norm block (RMSNorm's read, its fp32 square and
#: write, the residual add's two reads and one write): ``Layer.small``.
NORM_PASSES = 6
#: Passes over the (tokens x out) output an adapter adds beyond its scale and add (``planner.kernels.
#: ADAPTER_OUT_FORWARD_BYTES``): QLoRA's Linear4bit LoRA clones the base's output first (peft tuners/lora/bnb.py
#: ``Linear4bit.forward``: ``result = result.clone()``, "defensively clone"), a read and a write.
CLONE_PASSES = 2
#: Layer kinds the timeline knows the order of (q, k, v before attention, then o, then the MLP).
LAYER_KINDS = frozenset({"attn_in", "attn_out", "mlp_in", "mlp_out", "router"})


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """Host seconds of FSDP1's hooks around one unit."""

    before_wait: float
    """An unshard's host work before the rate limiter's wait (hook entry, pre-unshard)."""
    after_wait: float
    """From the wait to the all-gather's launch (and the views after it)."""
    post_forward: float
    """The post-forward: reshard, free event."""
    post_backward: float
    """The post-backward: reduce-scatter, cast back, reshard."""


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One decoder layer's items for the timeline: device seconds (forward) and host seconds.

    ``linears``: its linears in module order, each (the base's device seconds, its adapter's: lora_A,
    lora_B, the scaling and the add, None where not adapted; the base call's forward and backward host
    seconds); attention runs before linear ``attention_at`` (the output projection)."""

    linears: tuple[tuple[float, float | None, float, float], ...]
    attention_at: int
    attention: float
    attention_backward: float
    """Attention's backward over its forward (``planner.kernels.FUSED_BACKWARD_FLOPS``)."""
    small: float
    """A norm block's device seconds."""
    op_host: float
    """Host seconds per eager op (``planner.kernels.host_op_seconds``)."""


class Timeline:
    """The host and the device's compute stream, the host held back by the rate limiter's waits."""

    def __init__(self) -> None:
        self.host = 0.0  # when the host's next block starts
        self.tail = 0.0  # when the device has run everything launched so far
        self.busy = 0.0  # the device's kernel seconds
        self._frees: deque[float] = deque()  # the free events' completion times, oldest first

    def run(self, host_s: float, device_s: float = 0.0) -> None:
        """``host_s`` of host work, then a launch of ``device_s`` of kernels."""
        self.host += host_s
        if device_s:
            self.tail = max(self.tail, self.host) + device_s
            self.busy += device_s

    def unshard(self, hooks: Hooks) -> None:
        self.host += hooks.before_wait
        if len(self._frees) >= MAX_INFLIGHT_ALL_GATHERS:
            self.host = max(self.host, self._frees.popleft())  # event.synchronize()
        self.host += hooks.after_wait

    def reshard(self, host_s: float) -> None:
        self.host += host_s
        self._frees.append(self.tail)  # recorded on the compute stream: passed once all before it ran

    @property
    def exposed(self) -> float:
        """Seconds the device waited for the host."""
        return self.tail - self.busy


def _forward(t: Timeline, layer: Layer, hooks: Hooks) -> None:
    """The layer unit's forward (HF's decoder layer; peft's LoRA Linear: base, then lora_B(lora_A(x)))."""
    t.unshard(hooks)
    t.run(NORM_OPS * layer.op_host, layer.small)
    for n, (base, adapter, host, _) in enumerate(layer.linears):
        if n == layer.attention_at:
            t.run(ATTENTION_OPS * layer.op_host, layer.attention)
            t.run(NORM_OPS * layer.op_host, layer.small)
        t.run(host, base)
        if adapter is not None:
            for _unit in ("lora_A", "lora_B"):
                t.unshard(hooks)
                t.run(ADAPTER_UNIT_OPS * layer.op_host, adapter / 2)
                t.reshard(hooks.post_forward)
    t.reshard(hooks.post_forward)


def _backward(t: Timeline, layer: Layer, hooks: Hooks) -> None:
    """The backward through the recomputed layer: its pre-backward unshards it and prefetches its last
    adapter unit (the unit before it in post-forward order); each adapter unit's pre-backward prefetches
    the one before it (none for the layer's first: the previous layer's recompute has not run);
    autograd runs an adapter branch (later nodes first) before its frozen base's input gradient (one
    GEMM, no weight gradient), and an adapter unit's post-backward (its AccumulateGrad) before the
    next unit's pre-backward."""
    adapted = sum(adapter is not None for _, adapter, _, _ in layer.linears)
    t.unshard(hooks)
    if adapted:
        t.unshard(hooks)  # prefetch of the last adapter unit
    units = 2 * adapted
    done = 0
    for n in reversed(range(len(layer.linears))):
        base, adapter, _, host = layer.linears[n]
        if adapter is not None:
            for _unit in ("lora_B", "lora_A"):
                done += 1
                if done < units:
                    t.unshard(hooks)  # prefetch of the unit before
                t.run(2 * ADAPTER_UNIT_OPS * layer.op_host, adapter)  # input and weight gradients
                t.reshard(hooks.post_backward)
        t.run(host, base)
        if n == layer.attention_at:
            t.run(2 * NORM_OPS * layer.op_host, 2 * layer.small)
            t.run(2 * ATTENTION_OPS * layer.op_host, layer.attention * layer.attention_backward)
    t.run(2 * NORM_OPS * layer.op_host, 2 * layer.small)
    t.reshard(hooks.post_backward)  # the frozen layer's post-backward reshard-only hook


def exposed_seconds(layer: Layer, hooks: Hooks, *, layers: int, recompute: bool) -> float:
    """Device seconds a micro-step waits for the host: the forward over ``layers`` layers, then each
    layer's backward, after its recomputed forward when ``recompute`` (a reentrant checkpoint around
    the layer unit)."""
    t = Timeline()
    for _layer in range(layers):
        _forward(t, layer, hooks)
    for _layer in range(layers):
        if recompute:
            _forward(t, layer, hooks)
        _backward(t, layer, hooks)
    return t.exposed


__all__ = ["CLONE_PASSES", "LAYER_KINDS", "MAX_INFLIGHT_ALL_GATHERS", "NORM_PASSES", "Hooks",
           "Layer", "Timeline", "exposed_seconds"]
