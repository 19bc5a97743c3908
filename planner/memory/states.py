"""Model states: weights, gradients and optimizer states, and the batch-independent terms of a step.

Mixed-precision AdamW keeps 16 bytes per parameter (ZeRO paper §3.1: 2+2+12 with DeepSpeed;
with HF autocast fp32 weights 4 + fp32 grads 4 + two fp32 moments 8), the seeds' "16
bytes/param" rule (shared/seeds/001).
"""

from __future__ import annotations

from typing import NamedTuple

from planner.config import Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memo import IdentityMemo
from planner.memory.buffers import ROPE_CACHES_KEY, rope_cache_bytes
from planner.memory.dtypes import ADAPTER_BYTES, DtypeMode, mode_of, nf4_bytes, nf4_packed_bytes, trainable_bytes
from planner.memory.parameters import (
    Trained,
    largest_gradient_elements,
    param_tensor_sizes,
    quantized_linear_params,
    trained,
)
from planner.modelspec import ModelSpec
from planner.optim import OPTIMIZERS

#: the base model's tensors whatever the method (``param_tensor_sizes`` reads only the method)
_FULL = TrainConfig(method=Method.FULL)
#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note), and the search reads it thousands of times a search
_QLORA, _FULL_METHOD = Method.QLORA, Method.FULL


#: ``_model_terms`` by model: the search asks once per static key (516 calls an every-precision suggest)
_MODEL_TERMS = IdentityMemo(kept=64)


def _model_terms(model: ModelSpec) -> tuple[tuple[int, ...], int]:
    """(``base_tensor_sizes``, ``quantized_linear_params``) of ``model``, remembered."""
    hit = _MODEL_TERMS.get(model)
    if hit is None:
        hit = _MODEL_TERMS.put(model, None, (param_tensor_sizes(model, _FULL), quantized_linear_params(model)))
    return hit


def base_tensor_sizes(model: ModelSpec) -> tuple[int, ...]:
    """Element counts of the base model's parameter tensors, trainable or frozen (what a scheme
    that partitions every parameter, ZeRO-3, splits: ``ShardingSpec.model_states``)."""
    return _model_terms(model)[0]


def model_state_breakdown(model: ModelSpec, config: TrainConfig, t: Trained | None = None,
                          mode: DtypeMode | None = None) -> tuple[dict[str, int], int]:
    """(device bytes by component, host bytes) of weights, gradients and optimizer states
    (``t``: what the configuration trains, and ``mode``: its dtype mode, when the caller has them)."""
    t = t or trained(model, config)
    mode = mode or mode_of(config)
    trainable = t.count
    param_bytes = trainable_bytes(config.method, mode)
    out: dict[str, int] = {}
    base_sizes, q = _model_terms(model)  # (base_tensor_sizes, quantized_linear_params)
    if config.method is _QLORA:
        out["weights/nf4"] = int(nf4_bytes(q))
        # the non-4-bit tensors (norms, embeddings, head) in the mode's weight dtype: fp32 after
        # peft's k-bit upcast (prepare_model_for_kbit_training, peft 0.21 utils/other.py:204-209),
        # the compute dtype without it, and 16-bit where a library casts the model (DeepSpeed casts every
        # floating parameter, the upcast ones too, and leaves bitsandbytes' uint8 NF4 storage alone:
        # deepspeed 0.19.8 runtime/engine.py:1859-1862 ``p.data = p.data.to(param_dtype)``)
        out["weights/unquantized"] = (model.params_total - q) * mode.weight
    else:
        out["weights"] = model.params_total * mode.weight
    if config.method is not _FULL_METHOD:  # (uses_adapters)
        out["lora/weights"] = trainable * ADAPTER_BYTES
    # gradients, optimizer states and what the sharding scheme adds, splits or moves to the host
    spec = config.sharding.spec
    if config.method is _QLORA and spec.shards_4bit:  # (FSDP: the packed 4-bit weights are flat parameters)
        states, host = spec.model_states(model, config, t, out, param_bytes=param_bytes, grads=trainable * param_bytes,
                                         base_sizes=base_sizes, quantized=q, packed=nf4_packed_bytes(q))
    else:
        states, host = spec.model_states(model, config, t, out, param_bytes=param_bytes,
                                         grads=trainable * param_bytes, base_sizes=base_sizes)
    if config.rope_caches:  # buffers: on every rank whole, on the device whatever is offloaded (memory/buffers.py)
        states[ROPE_CACHES_KEY] = rope_cache_bytes(model, config, mode)
    return states, host


def model_states_bytes(model: ModelSpec, config: TrainConfig) -> int:
    """Weights + gradients + optimizer states on one device: the floor under any batch size."""
    states, _ = model_state_breakdown(model, config)
    return sum(states.values())


class StaticTerms(NamedTuple):
    """The batch-independent terms of one configuration on one device. (An immutable named tuple,
    made by position, as ``step.StaticSizes``: the search makes one per static key, ~490 a search,
    and a frozen dataclass of these fourteen fields took four times as long to make, 1.8 against
    0.45 us.)"""

    resident: dict[str, int]
    """Model states alive through the whole step, by component."""
    gradients: int
    """Gradient bytes once backward has produced them (and during accumulation)."""
    gathered: int
    """ZeRO-3: parameters gathered for the block running now (forward and backward only)."""
    paged: int
    """A paged optimizer's states in unified memory, outside the caching allocator: on the device
    as far as the allocator's reserve leaves room, on the host past it (``overhead.paged_on_host``)."""
    host: int
    """Host RAM (what the sharding scheme offloads)."""
    optimizer_step: int
    """Temporaries inside optimizer.step()."""
    optimizer_gradients: int
    """Gradient bytes alive while the optimizer steps."""
    zero_gradient_flatten: int = 0
    """Gradient copies the sharding scheme makes as the step begins (ZeRO-1/2 without offload:
    ``planner.sharding.zero.ZeRO.gradient_flatten``)."""
    held: int = 0
    """Held from the first forward to the end of backward (FSDP2's root unit, unsharded)."""
    reducing: int = 0
    """Alive in the last block's backward only (FSDP2's unsharded gradients and reduce-scatter input)."""
    reducing_end: int = 0
    """Alive at the end of backward only (FSDP2's root gradients unsharded, the last reduce-scatter input)."""
    step_checks: tuple[tuple[str, int], ...] = ()
    """The library's checks of the gradients as the step begins, made and freed one after the
    other before the flatten (``ShardingSpec.step_checks``: ZeRO-3's norm copy; its fp16 overflow test, on a side stream and
    never a moment's largest, the timeline draws alone: ``ShardingSpec.stream_checks``)."""
    paged_step: int = 0
    """Of ``paged``, what must be on the device at once: the states of the largest tensor, which
    bitsandbytes prefetches and updates alone (``OptimizerModel.largest_state_bytes``)."""
    tied_gradient_sum: int = 0
    """A trained embedding tied to the output head gets two partial gradients (the head's matmul
    and the embedding's backward), which autograd's input buffer adds into a third tensor: the
    two partials are alive with every other gradient at the end of backward (measured on gpt2)."""

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())


#: ``StaticTerms(...)`` without its generated ``__new__``'s Python frame (``collections.namedtuple`` makes it a
#: lambda around ``tuple.__new__``): the search makes one per static key, ~490 a search
_new_terms = tuple.__new__


def static_terms(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, t: Trained | None = None) -> StaticTerms:
    """The batch-independent terms of ``config`` on a device with these kernels. A paged
    optimizer's states are split off where they live in unified memory (bitsandbytes/functional.py
    ``get_paged``): max_memory_allocated does not see them, nvidia-smi does as far as they are
    resident; the step needs the largest tensor's at once (``OptimizerModel.largest_state_bytes``)."""
    t = t or trained(model, config)
    mode = mode_of(config)
    states, host = model_state_breakdown(model, config, t, mode)
    spec = config.sharding.spec
    optimizer = OPTIMIZERS[config.optimizer]
    param_bytes = trainable_bytes(config.method, mode)
    gradients = states.pop("gradients", 0)
    if config.optimizer_in_bwd:  # each gradient stepped and freed as it is made: the largest alone is alive
        gradients = min(gradients, largest_gradient_elements(t) * param_bytes)
    # the scheme's parts of the step (``ShardingSpec.keys`` with a ``size``): not resident
    parts: dict[str, int] = {}
    for k in spec.keys:
        if k.size:
            nbytes = states.pop(k.key, 0)  # a copy only gloo makes: on the CPU only
            parts[k.size] = parts.get(k.size, 0) + (0 if k.gloo_only and kernels.caching_allocator else nbytes)
    paged = paged_step = 0
    if optimizer.paged and kernels.unified_memory_paging:
        paged = states.pop("optimizer_states", 0)
        # (ZeRO refuses paged optimizers and FSDP2 bitsandbytes': each device steps whole tensors)
        paged_step = optimizer.memory.largest_state_bytes(t.size_counts, param_bytes)
    transient = 0
    # what the optimizer steps on the device (None: it steps on the host)
    stepped = spec.optimizer_tensors(t, config, param_bytes)
    if stepped is not None:
        # in backward, one optimizer per parameter steps one tensor at a time: the largest's temporaries
        counts = ((max(n for n, _ in stepped[0]), 1),) if config.optimizer_in_bwd and stepped[0] else stepped[0]
        transient = 0 if spec.fused_step(config, kernels) else optimizer.memory.step_transient(counts, stepped[1], kernels)
    tied = 0
    if model.tied_embeddings and config.method is _FULL_METHOD and not config.sharding.offloaded:
        tied = 2 * model.vocab_size * model.hidden_size * mode.weight
    # by position, in the fields' order, without the named tuple's Python ``__new__`` (``_new_terms``)
    return _new_terms(StaticTerms, (
        states,  # resident
        gradients,
        parts.get("gathered", 0),  # gathered
        paged,
        host,
        transient,  # optimizer_step
        spec.optimizer_gradients(t, config, gradients),  # optimizer_gradients
        spec.gradient_flatten(t, config) + parts.get("gradient_flatten", 0),  # zero_gradient_flatten
        parts.get("held", 0), parts.get("reducing", 0), parts.get("reducing_end", 0),  # held, reducing, reducing_end
        spec.step_checks(model, t, config),  # step_checks
        paged_step,
        tied,  # tied_gradient_sum
    ))

__all__ = ["StaticTerms", "model_state_breakdown", "model_states_bytes", "static_terms"]
