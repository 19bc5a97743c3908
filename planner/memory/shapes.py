"""The sizes one forward pass works with, and what one block's terms read about the configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Self

from planner.config import Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memo import IdentityMemo
from planner.memory.dtypes import DtypeMode, mode_of
from planner.memory.parameters import lora_targets
from planner.modelspec import LATENT_DOWN, LinearKind, LinearSpec, ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Dims:
    """Sizes one forward pass works with (per device, per micro-step)."""

    b: int
    """micro batch"""
    s: int
    """sequence length"""
    h: int
    """hidden size"""
    a: int
    """attention heads"""
    kv: int
    """key/value heads"""
    d: int
    """head dim"""
    i: int
    """intermediate size (times the experts each token visits)"""
    v: int
    """vocabulary"""
    tokens: int = field(init=False, repr=False, compare=False)
    """b * s: nearly every term reads it (a plain attribute, set as the dims are made)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", self.b * self.s)


#: ``dims_of`` by model, micro-batch and sequence length: the sizes are immutable, and the search asks
#: for the same few (each batch line's micro-batches 1 and 2) ~500 times a search
_DIMS = IdentityMemo(kept=256)


def dims_of(model: ModelSpec, config: TrainConfig) -> Dims:
    key = (config.micro_batch, config.seq_len)
    hit = _DIMS.get(model, key)
    if hit is not None:
        return hit
    inter = model.intermediate_size
    if model.is_moe:
        # tokens are routed to top-k experts: k intermediate activations per token
        inter = model.intermediate_size * model.experts_per_token
    return _DIMS.put(model, key, Dims(b=config.micro_batch, s=config.seq_len, h=model.hidden_size, a=model.num_heads,
                                      kv=model.num_kv_heads, d=model.head_dim, i=inter, v=model.vocab_size))


class _ContextFields(NamedTuple):
    """``BlockContext``'s fields, the derived ones after the seven it is made from."""

    model: ModelSpec
    config: TrainConfig
    dims: Dims
    mode: DtypeMode
    kernels: KernelProfile
    first: bool
    """The block reading the (frozen, for LoRA) embedding's output."""
    targets: frozenset[str]
    """``LinearSpec.key`` of each linear LoRA adapts (empty for full fine-tuning)."""
    full: bool
    """Full fine-tuning."""
    block_input_needs_grad: bool
    """Autograd saves an operand only when the other operand needs a gradient. In the first
    block under LoRA nothing upstream of the first adapter needs one, unless checkpointing
    makes the inputs require grad (peft's ``enable_input_require_grads``)."""
    lora_dropout: bool
    """PEFT applies an ``nn.Dropout`` to each adapter's input (Identity when p == 0)."""
    adapter_saves_shared_input: bool
    """lora_A saves the very tensor the base layer reads (no cast, no dropout in between): fp32
    LoRA and QLoRA without autocast. Otherwise it saves its own cast or its own dropped copy."""
    adapted: tuple[LinearSpec, ...]
    """The block's linears LoRA adapts, in the block's order."""
    targeted_kinds: frozenset[LinearKind]
    """The kinds of the block's linears LoRA adapts at least one of."""
    adapted_by_kind: dict[LinearKind, tuple[LinearSpec, ...]]
    """``adapted`` by kind (``adapted_of``), in the block's order."""
    o_targeted: bool
    """LoRA adapts the attention's output projection."""
    attn_targeted: bool
    """LoRA adapts an attention projection, input or output."""


#: a tuple of a class's fields made without the class's ``__new__`` (all C: ``collections.namedtuple``'s ``_make``)
_new = tuple.__new__


class BlockContext(_ContextFields):
    """Everything one transformer block's activation terms depend on. What the terms read of the
    configuration is derived once, as the context is made (``__new__``): a block's terms
    read it dozens of times. (An immutable named tuple, not a frozen dataclass, as ``Dims``' users
    read it alike: each of the search's batch lines makes a context and copies it up to three
    times (``batch_line``: the later block at micro-batch 2, the first block at 1 and 2 where it
    differs), and a frozen dataclass' copy, slot by slot, cost half as much as the block's terms.)"""

    __slots__ = ()

    def __new__(cls, *, model: ModelSpec, config: TrainConfig, dims: Dims, mode: DtypeMode, kernels: KernelProfile,
                first: bool, targets: frozenset[str]) -> Self:
        full = config.method is _FULL
        lora_dropout = drops_adapter_inputs(config)
        by_kind: dict[LinearKind, tuple[LinearSpec, ...]] = {}
        # bare weights (expert stacks, routers) take peft's ParamWrapper, which merges its adapter into
        # the weight instead of adapting the activations: planner.memory.moe counts them
        adapted = tuple([lin for lin in model.layer_linears if lin.key in targets and lin.module]) if targets else ()
        for lin in adapted:
            by_kind[lin.kind] = by_kind.get(lin.kind, ()) + (lin,)
        return _new(cls, (
            model, config, dims, mode, kernels, first, targets,
            full, block_input_needs_grad(config, first=first), lora_dropout,
            not full and not mode.adapter_input and not lora_dropout,  # adapter_saves_shared_input
            adapted, frozenset(by_kind), by_kind,  # adapted, targeted_kinds, adapted_by_kind
            _ATTN_OUT in by_kind,  # o_targeted
            _ATTN_IN in by_kind or _ATTN_OUT in by_kind,  # attn_targeted
        ))

    def _but(self, **changed) -> BlockContext:
        """This context with ``changed`` fields, the derived ones as they are (the callers change
        only what those do not read, or also what they derive from it)."""
        return self._replace(**changed)

    def at(self, config: TrainConfig, dims: Dims) -> BlockContext:
        """This block in ``config``, which differs from this one's in its micro-batch only, or for a
        later block in checkpointing too, at its sizes ``dims``: nothing derived reads the micro-batch,
        and a later block's input needs a gradient either way (``block_input_needs_grad``)."""
        return _new(BlockContext, self[:1] + (config, dims) + self[3:])

    def as_first(self, first: bool) -> BlockContext:
        """This context as the first block or a later one: only whether its input needs a gradient
        depends on it."""
        return _new(BlockContext, self[:5] + (first,) + self[6:8]
                    + (block_input_needs_grad(self.config, first=first),) + self[9:])

    def of_kind(self, kind: LinearKind) -> tuple[LinearSpec, ...]:
        return self.model.linears_by_kind[kind]

    def targeted(self, lin: LinearSpec) -> bool:
        return lin.key in self.targets

    def adapted_of(self, kind: LinearKind) -> tuple[LinearSpec, ...]:
        """The linears of ``kind`` LoRA adapts."""
        return self.adapted_by_kind.get(kind, ())

    @property
    def attn_out(self) -> tuple[LinearSpec, ...]:
        return self.of_kind(_ATTN_OUT)

    def input_needs_grad(self, lin: LinearSpec) -> bool:
        """Whether the input a linear of the block reads needs a gradient: everything does but, in
        the first LoRA block without checkpointing, what only frozen layers computed. An MoE
        router reads what the experts' input linears read. In an encoder-decoder's first decoder
        block, the cross-attention's k and v read the encoder output, which needs a gradient when
        the encoder has adapters: with LoRA it always has (T5's encoder and decoder linears have
        the same names, q/k/v/o/wi/wo, so targets adapt both stacks), and so does everything
        after the cross-attention; its q reads the self-attention's output."""
        if self.block_input_needs_grad:
            return True
        kind, attention = lin.kind, (_ATTN_IN, _ATTN_OUT)
        if lin.name in LATENT_DOWN and self.model.latent_attention is not None:
            # MLA's q_b_proj/kv_b_proj read their down projection's normed output
            return LATENT_DOWN[lin.name] in self.targets
        if kind is _ATTN_IN:
            return False
        if kind is _ATTN_OUT or (kind is _CROSS_ATTN_IN and lin.name == "q"):
            upstream = attention[:1] if kind is _ATTN_OUT else attention
        elif self.of_kind(_CROSS_ATTN_IN):  # after the encoder output, in a decoder block
            return bool(self.targets)
        elif kind in (_MLP_IN, _ROUTER, _SHARED_GATE):
            upstream = () if self.model.parallel_block else attention
        else:
            assert kind is _MLP_OUT, kind
            upstream = (_MLP_IN,) + (() if self.model.parallel_block else attention)
        return any(kind in self.targeted_kinds for kind in upstream)


#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search reads these thousands of times a search
_FULL = Method.FULL
_ATTN_IN, _ATTN_OUT, _CROSS_ATTN_IN = LinearKind.ATTN_IN, LinearKind.ATTN_OUT, LinearKind.CROSS_ATTN_IN
_MLP_IN, _MLP_OUT = LinearKind.MLP_IN, LinearKind.MLP_OUT
_ROUTER, _SHARED_GATE = LinearKind.ROUTER, LinearKind.SHARED_GATE


def drops_adapter_inputs(config: TrainConfig) -> bool:
    """Each LoRA adapter runs its input through its own ``nn.Dropout`` (peft/tuners/lora/layer.py
    ``update_layer``: Identity when p == 0), which keeps its mask and a dropped copy of the input:
    the activations (``BlockContext.lora_dropout``) and the kernels' traffic (planner.kernels) read it."""
    return config.method is not _FULL and config.lora_dropout > 0


def block_input_needs_grad(config: TrainConfig, *, first: bool) -> bool:
    """``BlockContext.block_input_needs_grad`` of the first block or a later one."""
    return config.method is _FULL or not first or config.grad_ckpt


def block_context(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, *, first: bool,
                  targets: frozenset[str] | None = None, dims: Dims | None = None,
                  mode: DtypeMode | None = None) -> BlockContext:
    """``targets`` (the adapted linears' names), ``dims`` and ``mode``: when the caller has them already."""
    if targets is None:
        targets = frozenset(lin.key for lin in lora_targets(model, config))
    return BlockContext(model=model, config=config, dims=dims or dims_of(model, config), mode=mode or mode_of(config),
                        kernels=kernels, first=first, targets=targets)


__all__ = ["BlockContext", "Dims", "block_context", "block_input_needs_grad", "dims_of", "drops_adapter_inputs"]
