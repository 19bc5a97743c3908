"""The sizes one forward pass works with, and what one block's terms read about the configuration."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.config import Method, TrainConfig
from planner.gpus import KernelProfile
from planner.memory.dtypes import DtypeMode, mode_of
from planner.memory.parameters import lora_targets
from planner.modelspec import LinearKind, LinearSpec, ModelSpec


@dataclass(frozen=True, kw_only=True)
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

    @property
    def tokens(self) -> int:
        return self.b * self.s


def dims_of(model: ModelSpec, config: TrainConfig) -> Dims:
    inter = model.intermediate_size
    if model.is_moe:
        # tokens are routed to top-k experts: k intermediate activations per token
        inter = model.intermediate_size * model.experts_per_token
    return Dims(b=config.micro_batch, s=config.seq_len, h=model.hidden_size, a=model.num_heads,
                kv=model.num_kv_heads, d=model.head_dim, i=inter, v=model.vocab_size)


@dataclass(frozen=True, kw_only=True)
class BlockContext:
    """Everything one transformer block's activation terms depend on."""

    model: ModelSpec
    config: TrainConfig
    dims: Dims
    mode: DtypeMode
    kernels: KernelProfile
    first: bool
    """The block reading the (frozen, for LoRA) embedding's output."""
    targets: frozenset[str]
    """Names of the linears LoRA adapts (empty for full fine-tuning)."""

    @functools.cached_property
    def full(self) -> bool:
        return self.config.method is Method.FULL

    @functools.cached_property
    def block_input_needs_grad(self) -> bool:
        """Autograd saves an operand only when the other operand needs a gradient. In the first
        block under LoRA nothing upstream of the first adapter needs one, unless checkpointing
        makes the inputs require grad (peft's ``enable_input_require_grads``)."""
        return self.full or not self.first or self.config.grad_ckpt

    def of_kind(self, kind: LinearKind) -> tuple[LinearSpec, ...]:
        return self.model.linears_by_kind[kind]

    def targeted(self, lin: LinearSpec) -> bool:
        return lin.name in self.targets

    @property
    def attn_out(self) -> tuple[LinearSpec, ...]:
        return self.of_kind(LinearKind.ATTN_OUT)

    @functools.cached_property
    def o_targeted(self) -> bool:
        return any(self.targeted(lin) for lin in self.attn_out)

    @functools.cached_property
    def attn_targeted(self) -> bool:
        return any(self.targeted(lin) for lin in self.of_kind(LinearKind.ATTN_IN) + self.attn_out)

    @property
    def lora_dropout(self) -> bool:
        """PEFT applies an ``nn.Dropout`` to each adapter's input (Identity when p == 0)."""
        return not self.full and self.config.lora_dropout > 0

    @property
    def adapter_saves_shared_input(self) -> bool:
        """lora_A saves the very tensor the base layer reads (no cast, no dropout in between): fp32
        LoRA and QLoRA without autocast. Otherwise it saves its own cast or its own dropped copy."""
        return not self.full and not self.mode.adapter_input and not self.lora_dropout

    def input_needs_grad(self, lin: LinearSpec) -> bool:
        """Whether the input a linear of the block reads needs a gradient: everything does but, in
        the first LoRA block without checkpointing, what only frozen layers computed."""
        if self.block_input_needs_grad:
            return True
        upstream = {
            LinearKind.ATTN_IN: (),
            LinearKind.ATTN_OUT: (LinearKind.ATTN_IN,),
            LinearKind.MLP_IN: () if self.model.parallel_block else (LinearKind.ATTN_IN, LinearKind.ATTN_OUT),
            LinearKind.MLP_OUT: (LinearKind.MLP_IN,) + (() if self.model.parallel_block else (LinearKind.ATTN_IN, LinearKind.ATTN_OUT)),
        }[lin.kind]
        return any(self.targeted(other) for kind in upstream for other in self.of_kind(kind))


def block_context(model: ModelSpec, config: TrainConfig, kernels: KernelProfile, *, first: bool,
                  targets: frozenset[str] | None = None, dims: Dims | None = None) -> BlockContext:
    """``targets`` (the adapted linears' names) and ``dims``: when the caller has them already."""
    if targets is None:
        targets = frozenset(lin.name for lin in lora_targets(model, config))
    return BlockContext(model=model, config=config, dims=dims or dims_of(model, config), mode=mode_of(config),
                        kernels=kernels, first=first, targets=targets)


__all__ = ["BlockContext", "Dims", "block_context", "dims_of"]
