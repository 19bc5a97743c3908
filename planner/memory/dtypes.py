"""Element sizes: how each tensor of a training step is typed in one configuration.

The one home of the dtype facts the memory and throughput models share: the bytes of the
trainable tensors (peft keeps adapters in fp32), the NF4 and 8-bit block layouts of bitsandbytes,
and the dtype mode a (method, precision, sharding) combination runs in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from planner.config import Method, Precision
from planner.optim.bnb import BNB_8BIT_BLOCK, BNB_8BIT_STATE_BYTES, BNB_MIN_8BIT_SIZE
from planner.optim.spec import FP32, HALF

# FP32 (bytes of an fp32 element: master weights, optimizer moments, log-probabilities), HALF (of
# an fp16/bf16 element) and the 8-bit optimizer layout of bitsandbytes are defined with the
# optimizers (planner.optim).
#: bytes of an int64 element (token ids and labels the embedding and the loss keep)
INT64 = 8

#: LoRA adapters are fp32 whatever the model's dtype: peft upcasts fp16/bf16 adapter weights
#: (``autocast_adapter_dtype=True`` default, peft/tuners/tuners_utils.py ``_cast_adapter_dtype``),
#: so their gradients and torch optimizer states are fp32 too.
ADAPTER_BYTES = FP32

#: bitsandbytes NF4: 4 bits per weight, one absmax per block of 64 (bnb.functional.quantize_4bit
#: blocksize=64 for 4-bit); with double quantisation the absmax are 8-bit with one fp32 scale per
#: 256 of them (QLoRA paper, Dettmers et al. 2023, §3: 0.127 bits/param instead of 0.5).
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256
#: NF4 bytes read per weight: 0.5 B plus the block constants (8/64 + 32/(64*256) bit with double
#: quantisation, the layout of ``nf4_bytes``).
NF4_READ_BYTES = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_DQ_BLOCK)


def nf4_packed_bytes(n: int) -> float:
    """Bytes of n weights' packed 4-bit codes alone, two to a byte (bitsandbytes 0.50.2
    backends/default/ops.py:256 ``(q8[::2] << 4) | q8[1::2]``), whatever dtype
    ``bnb_4bit_quant_storage`` views them as (:257-258): the part of ``nf4_bytes`` that is the
    parameter's data; the rest is its quantisation state."""
    return n / 2


def nf4_bytes(n: int) -> float:
    """Bytes of n weights stored as bitsandbytes NF4 with double quantisation."""
    blocks = n / NF4_BLOCK
    return nf4_packed_bytes(n) + blocks * 1 + (blocks / NF4_DQ_BLOCK) * 4


@dataclass(frozen=True, kw_only=True)
class DtypeMode:
    """How tensors are typed in this configuration (bytes per element)."""

    autocast: bool
    """HF mixed precision: fp32 weights, matmuls in 16-bit under torch.autocast."""
    compute: int
    """bytes of projection outputs (MLP intermediates)."""
    attn: int
    """bytes of the tensors the attention kernel saves (q, k, v, out)."""
    residual: int
    """bytes of the residual stream (fp32 under autocast, else the model dtype)."""
    weight: int
    """bytes of a stored (unquantised) weight element."""
    adapter_input: int
    """bytes of the input copy each LoRA adapter saves (0: it shares the base layer's input)."""
    adapter: int = FP32
    """bytes of what LoRA's adapters compute (lora_A's and lora_B's outputs): peft's fp32
    adapters, 16-bit under autocast or in a model a library casts to 16 bits with its adapters
    (DeepSpeed, FSDP2's param_dtype)."""
    adapter_weight: int = FP32
    """bytes of the adapters' weights as the layers compute with them, the dtype peft casts an
    adapter's input to (``_cast_input_dtype``): peft's fp32 (ADAPTER_BYTES), 16-bit in a model a
    library casts with its adapters."""
    fp8: bool = False
    """torchao's float8 linears (``Precision.FP8``): a converted linear (``fp8_converts``) saves its
    fp32 weight itself, not a 16-bit cast (torchao float8/float8_linear.py:45
    ``ctx.save_for_backward(input_hp, weight_hp_t)``, ``weight_hp_t = self.weight.t()``, a view; under
    autocast the fp8 weight is only relabelled, float8_ops.py ``autocast_to_copy``), and casts its
    operands to fp8 per GEMM (``planner.memory.activations.fp8_cast_terms``)."""
    logits: int = field(init=False, repr=False, compare=False)
    """bytes of the lm_head's output: 16-bit under autocast, else the weights' dtype (a plain
    attribute: the output terms read it at every micro-batch the search tries)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logits", HALF if self.autocast else self.weight)


#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search reads it thousands of times a search
_FULL = Method.FULL


def trainable_bytes(method: Method, mode: DtypeMode) -> int:
    """Bytes per element of the trainable tensors on the device, their gradients and torch
    optimizer states: the weights' dtype for full fine-tuning, fp32 adapters otherwise."""
    return mode.weight if method is _FULL else ADAPTER_BYTES


@functools.cache
def dtype_mode(method: Method, precision: Precision, casts_model: bool, kbit_upcast: bool = True) -> DtypeMode:
    """The dtype mode of (method, precision), with or without a sharding library that casts the
    model to 16 bits (``ShardingSpec.casts_model``: DeepSpeed), and for QLoRA with or without the
    k-bit preparation's fp32 upcast (``TrainConfig.kbit_upcast``)."""
    lora = method.uses_adapters
    p = precision
    if casts_model and p.is_mixed:
        # A library that casts the model to 16 bits computes with 16-bit parameters, LoRA's
        # adapters included: DeepSpeed's bf16/fp16 mode casts every floating parameter
        # (deepspeed 0.19.8 runtime/engine.py _cast_module_mixed_precision: ``p.data =
        # p.data.to(param_dtype)``) and keeps the fp32 master copy in the optimizer partition;
        # FSDP2's MixedPrecisionPolicy gathers every parameter of a unit, peft's fp32 adapters
        # too, in param_dtype (torch fsdp/_fully_shard/_fsdp_param.py init_dtype_attrs). No
        # autocast: activations are those of a pure 16-bit model, and peft's cast of an adapter's
        # input to the adapter's dtype (tuners_utils.py ``_cast_input_dtype``) copies nothing:
        # measured on 2 CPU ranks (llama-8k, LoRA all-linear), FSDP2, ZeRO-2 and ZeRO-3 keep no
        # fp32 copy of an adapter's input (the mode counted one per adapter: +3.6 %, +9.2 %, +9.1 %).
        return DtypeMode(autocast=False, compute=2, attn=2, residual=2, weight=2, adapter_input=0, adapter=HALF,
                         adapter_weight=HALF)
    if method is Method.QLORA and not kbit_upcast and p is not Precision.FP32:
        return _qlora_16bit(p)
    if method is Method.QLORA:
        # peft.prepare_model_for_kbit_training upcasts every non-4-bit parameter to fp32
        # (peft/utils/other.py), so the residual stream is fp32; bnb's Linear4bit casts its input
        # to the compute dtype and its output back to the input dtype (bitsandbytes/nn/modules.py
        # Linear4bit.forward), so projection outputs are fp32 too; only under autocast does SDPA
        # cast q/k/v to 16-bit.
        return DtypeMode(
            autocast=p.is_mixed, compute=4, attn=2 if p.is_mixed else 4, residual=4, weight=4,
            adapter_input=2 if p.is_mixed else 0, adapter=HALF if p.is_mixed else FP32,
        )
    if p is Precision.FP32:
        return DtypeMode(autocast=False, compute=4, attn=4, residual=4, weight=4, adapter_input=0)
    if p.is_mixed:
        # autocast casts the fp32 input anew for every linear call, adapters included; fp8's Float8Linear
        # casts its input to the autocast dtype itself and saves that cast (float8_linear.py:258-262, :45)
        return DtypeMode(autocast=True, compute=2, attn=2, residual=4, weight=4, adapter_input=2, adapter=HALF,
                         fp8=p is Precision.FP8)
    # pure 16-bit: peft keeps adapters in fp32 (ADAPTER_BYTES) and casts each adapter's input to
    # fp32 (LoraLayer._cast_input_dtype): one fp32 copy per adapter
    return DtypeMode(autocast=False, compute=2, attn=2, residual=2, weight=2, adapter_input=4 if lora else 0)


def _qlora_16bit(p: Precision) -> DtypeMode:
    """QLoRA whose non-4-bit parameters stay in the 16-bit dtype they were loaded in (no
    ``prepare_model_for_kbit_training``): the embedding's output, the residual adds and the norms'
    outputs are 16-bit (transformers 5.24 models/llama/modeling_llama.py:62-67, ``LlamaRMSNorm``
    computes in fp32 but returns ``self.weight * hidden_states.to(input_dtype)``, a 16-bit weight
    times a 16-bit input); bitsandbytes' Linear4bit computes in its compute dtype and returns its
    input's dtype (bitsandbytes 0.50.2 nn/modules.py:626-637: ``x.to(self.compute_dtype)``, then
    ``matmul_4bit(...).to(inp_dtype)``), 16-bit here, so every projection output and what the
    activations save are 16-bit, and SDPA saves 16-bit q/k/v/out. peft's adapters stay fp32
    (ADAPTER_BYTES): each casts its 16-bit input to fp32 (peft 0.21 tuners_utils.py:2220-2235
    ``_cast_input_dtype``); under autocast lora_A then casts that to 16 bits again and saves the
    16-bit cast (the fp32 copy dies), without autocast it saves the fp32 copy (as pure 16-bit LoRA).
    fp32 itself loads fp32 and is the upcast mode (nothing to upcast)."""
    mixed = p.is_mixed
    return DtypeMode(autocast=mixed, compute=HALF, attn=HALF, residual=HALF, weight=HALF,
                     adapter_input=HALF if mixed else FP32, adapter=HALF if mixed else FP32)


#: Model types whose block linears are transformers' ``Conv1D``, not ``nn.Linear`` (models/gpt2/modeling_gpt2.py):
#: torchao swaps ``nn.Linear`` modules only (float8/float8_linear_utils.py:72 ``isinstance(module, nn.Linear)``).
FP8_CONV1D_MODEL_TYPES = frozenset({"gpt2"})
#: accelerate converts a linear only when both its dims divide by 16 (accelerate utils/ao.py:65
#: ``filter_linear_layers``; torch._scaled_mm needs multiples of 16).
FP8_DIM_MULTIPLE = 16


def fp8_converts(model, lin) -> bool:
    """Whether accelerate's torchao backend turns this block linear into a ``Float8Linear``: an
    ``nn.Linear`` module (not a bare expert stack or router weight) with both dims multiples of 16.
    The model's first and last linears are left alone as well (utils/ao.py:140-142
    ``layers_to_filter=[first_linear, last_linear]``): the lm_head, and the first block's first
    linear (``planner.memory.activations`` counts its weight cast apart)."""
    return (lin.module and model.model_type not in FP8_CONV1D_MODEL_TYPES
            and lin.in_features % FP8_DIM_MULTIPLE == 0 and lin.out_features % FP8_DIM_MULTIPLE == 0)


def mode_of(config) -> DtypeMode:
    """The dtype mode of a ``TrainConfig``."""
    return dtype_mode(config.method, config.precision, config.sharding.spec.casts_model, config.kbit_upcast)


__all__ = [
    "ADAPTER_BYTES", "BNB_8BIT_BLOCK", "BNB_8BIT_STATE_BYTES", "BNB_MIN_8BIT_SIZE", "DtypeMode", "FP32", "HALF",
    "FP8_CONV1D_MODEL_TYPES", "FP8_DIM_MULTIPLE", "INT64", "NF4_BLOCK", "NF4_DQ_BLOCK", "NF4_READ_BYTES", "dtype_mode", "fp8_converts", "mode_of", "nf4_bytes", "nf4_packed_bytes", "trainable_bytes",
]
