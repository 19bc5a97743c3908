"""The training configuration: one fully specified way to fine-tune a model.

A ``TrainConfig`` is what ``planner estimate`` predicts, what ``planner suggest`` enumerates,
what the workers run and what the store keeps. It is a frozen, keyword-only dataclass validated
where it is made: a configuration that cannot exist raises ``InvalidConfigError`` with the fix,
a combination the memory model does not cover raises ``UnsupportedError``.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import InvalidConfigError, UnsupportedError, choice
from planner.optim import Optimizer
from planner.request import FIELDS
from planner.sharding import NONE, Offload, Sharding, for_gpus, from_zero


class Method(enum.StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"

    @property
    def uses_adapters(self) -> bool:
        return self is not _FULL


class Precision(enum.StrEnum):
    """``*-mixed``: fp32 weights with autocast (HF Trainer's fp16=True / bf16=True).
    Plain ``fp16``/``bf16``: weights, gradients and optimizer states in that dtype.
    For QLoRA the precision names the compute dtype of the 4-bit layers.

    ``fp8``: bf16-mixed with torchao's float8 linear layers, as accelerate runs it with
    ``mixed_precision: fp8`` and the torchao backend (accelerate 1.x accelerator.py ``_prepare_ao``
    converts the model with ``convert_model_to_fp8_ao``; utils/modeling.py
    ``get_mixed_precision_context_manager`` keeps bf16 autocast on for "fp8"): fp32 weights, master
    copy and optimizer states as under bf16-mixed; every ``nn.Linear`` but the model's first and last
    (the lm_head) whose dims divide by 16 (accelerate utils/ao.py ``filter_linear_layers``) runs its
    three GEMMs on fp8 operands cast per call with dynamic tensorwise scales (torchao
    float8/config.py: the default recipe). Needs FP8 tensor cores (``GPUSpec.fp8``)."""

    FP32 = "fp32"
    FP16_MIXED = "fp16-mixed"
    BF16_MIXED = "bf16-mixed"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def is_mixed(self) -> bool:
        """fp32 weights with 16-bit autocast compute (fp8 included: its autocast is bf16)."""
        return self in _MIXED

    @property
    def needs_bf16(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.BF16, Precision.FP8)

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the stored (trainable or frozen) weights."""
        return 4 if self in _FP32_WEIGHTS else 2

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations: the dtype the matmuls run in."""
        return 4 if self is _FP32 else 2

    @property
    def compute_dtype(self) -> str:
        if self is Precision.FP32:
            return "float32"
        return "bfloat16" if self.needs_bf16 else "float16"


class Attention(enum.StrEnum):
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH = "flash"

    @property
    def hf_name(self) -> str:
        """The value of transformers' ``attn_implementation``."""
        return "flash_attention_2" if self is Attention.FLASH else self.value


class Loop(enum.StrEnum):
    """How the training step is written: it decides how long the model's outputs live."""

    TRAINER = "trainer"
    """HF Trainer: ``compute_loss`` returns the loss alone (transformers/trainer.py ``training_step``
    calls ``compute_loss(model, inputs)`` with ``return_outputs=False``), so the outputs (logits,
    KV cache) die before ``backward``."""
    MANUAL = "manual"
    """The common hand-written loop ``outputs = model(**batch); loss = outputs.loss; loss.backward();
    optimizer.step(); optimizer.zero_grad()``: ``outputs`` (the logits, a KV cache if one was built)
    stays alive through backward and the optimizer step until the next forward returns and the name
    is bound to the new outputs."""


#: The newest version of ``TrainConfig.to_dict`` payloads this code writes; one without a ``version``
#: key was written before payloads carried one (version 1, no ``alloc_conf``). The recipe knobs
#: (``lora_dropout``, ``loop``, ``fused_ce``, ``packing``, ``use_cache``) were added within version 2:
#: a payload without them decodes to their defaults, which are the behaviour it was planned with.
#: torchtune's ``optimizer_in_bwd`` and ``loss_chunks`` were added within version 3 the same way,
#: written only where set, and so were QLoRA's ``kbit_upcast`` and the loss' ``loss_upcast`` (written
#: only where False) and ``loss_shift``, ``loss_returns_head``, ``reentrant_ckpt``, ``experts_loop``, ``experts_list_index``, ``rope_caches`` and ``compile`` (only where True), and ``rope_scaling`` (only where set).
#: Version 3 names the sharding scheme (``sharding``, ``planner.sharding``) where no ``--zero``
#: stage names it; a configuration whose scheme a stage names (none, DDP, ZeRO-1/2/3) is still
#: written as version 2 (``zero`` and ``offload``), so that version-2 readers read it and stored
#: plans and answers keep their bytes.
CONFIG_VERSION = 3
#: The version of payloads whose sharding a ``--zero`` stage names (``Sharding.payload``).
_ZERO_PAYLOAD_VERSION = 2

#: ``lora_targets`` value that adapts every linear layer but the output head (peft's "all-linear").
ALL_LINEAR = "all-linear"

#: Defaults applied to LoRA/QLoRA configurations when the user names none.
DEFAULT_LORA_R = 16
DEFAULT_LORA_TARGETS: tuple[str, ...] = (ALL_LINEAR,)


#: Sanity bounds: far above any real run, low enough that every derived byte count fits the store's
#: 64-bit integers (1M sequences per step, 16M tokens per sequence, 64k devices).
_UPPER_BOUNDS = {name: f.upper for name, f in FIELDS.items() if f.upper is not None}  # (planner.request's)


def _check_count(name: str, value: Any) -> None:
    """A whole number from 1 to the field's sanity bound, or the one-line error naming the option."""
    if type(value) is int and 0 < value <= _UPPER_BOUNDS[name]:  # the common case (bool is not int exactly)
        return
    flag = name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"--{flag} must be a whole number >= 1, got {value!r}")
    if value > _UPPER_BOUNDS[name]:
        raise InvalidConfigError(f"--{flag} {value} is beyond any training run (at most {_UPPER_BOUNDS[name]:,}): check the number")


def _check_dropout(value: Any) -> float:
    """PEFT's ``lora_dropout``: a probability in [0, 1) (nn.Dropout refuses p outside [0, 1]; p = 1
    drops every input and trains nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise InvalidConfigError(f"--lora-dropout must be a probability from 0 to below 1 (recipes use 0.05-0.1), got {value!r}")
    return float(value)


#: The RoPE scaling types ``--rope-scaling`` takes: LLaMA-Factory's (extras/constants.py ``RopeScaling``), each one
#: of transformers' ``ROPE_INIT_FUNCTIONS`` (5.24 modeling_rope_utils.py l.669-676; longrope needs per-dimension
#: factor lists a plan does not carry). The first is the type a bare FACTOR means (linear: position interpolation).
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
#: A sanity bound on the factor, far above any published extension (Llama 3.1's is 8, YaRN's papers go to 32).
ROPE_FACTOR_MAX = 1024


def _rope_scaling(value: Any) -> str:
    """``--rope-scaling`` in its canonical spelling ``TYPE:FACTOR`` (a bare factor is linear's), or the one-line
    error with the fix."""
    text = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    kind, _, factor = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    kind = kind.strip().lower() or ROPE_TYPES[0]
    try:
        number = float(factor)
    except ValueError:
        number = float("nan")
    if kind not in ROPE_TYPES or not 1.0 < number <= ROPE_FACTOR_MAX:
        raise InvalidConfigError(f"--rope-scaling takes FACTOR or TYPE:FACTOR, TYPE one of {'|'.join(ROPE_TYPES)} and "
                                 f"FACTOR a number above 1 (at most {ROPE_FACTOR_MAX}), e.g. 4 or yarn:4; got {value!r}")
    return f"{kind}:{number:g}"


def rope_scaling_of(source: Any) -> Any:
    """The ``--rope-scaling`` value of a configuration, a search space (any object with the recipe
    fields as attributes) or a mapping of options (None: not given)."""
    if source is None:
        return None
    return source.get("rope_scaling") if isinstance(source, Mapping) else getattr(source, "rope_scaling", None)


#: model types whose full-attention layers' rotary type is transformers 5.24's "proportional" (configuration_gemma4.py
#: l.201-203: the full-attention layers rotate a quarter of each head, partial_rotary_factor 0.25, zero frequencies
#: for the rest; modeling_rope_utils.py l.194-267). No published recipe extends it, and none of ``ROPE_TYPES`` keeps
#: that layout (linear, dynamic, yarn and llama3 would replace it with their own type): refused (``_unscalable_rope``),
#: not silently unscaled.
PROPORTIONAL_ROPE = frozenset({"gemma4_text"})


def _unscalable_rope(spec: Any) -> str | None:
    """Why ``spec``'s RoPE takes no ``--rope-scaling`` (None: it takes one): transformers' "proportional" type
    (``PROPORTIONAL_ROPE``), or a scaling its config.json already carries (Llama 3.1's llama3 x8, Gemma 3 4B+'s linear
    x8 on its full-attention layers), which the requested one would replace, not extend: the merge train.py and
    the worker make (``planner.emit.settings.scale_rope``) is transformers' own (configuration_gemma3.py l.143,
    ``update``), and no rule composes two scalings' types."""
    config = getattr(spec, "config", None) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    layers = [v for v in rope.values() if isinstance(v, Mapping)] or [rope]
    kinds = [(layer.get("rope_type") or layer.get("type"), layer.get("factor")) for layer in layers]
    if getattr(spec, "model_type", "") in PROPORTIONAL_ROPE or any(kind == "proportional" for kind, _ in kinds):
        return (f"has no rule for {spec.id}'s \"proportional\" RoPE (Gemma 4's full-attention layers: none of "
                f"{'|'.join(ROPE_TYPES)} keeps it)")
    scaled = [f"{kind} x{factor:g}" if isinstance(factor, (int, float)) else str(kind)
              for kind, factor in kinds if kind not in (None, "default")]
    if scaled:
        return (f"would replace the RoPE scaling {spec.id}'s config already has ({', '.join(scaled)}), not extend it "
                "(no rule composes two)")
    return None


def context_limit(spec: Any, source: Any = None) -> int:
    """The longest sequence ``spec`` takes: its position table's length (``ModelSpec.max_seq_len``, the model's
    max_position_embeddings or n_positions), times the RoPE scaling factor where ``source`` (a configuration,
    a search space or a mapping of options: ``rope_scaling_of``) gives one. The one home of that limit
    (estimate, suggest, --max-seq, --dataset, check). A model whose positions are not rotary refuses the
    scaling: a learned table (gpt2, opt, bert) has no row past its length, ALiBi (bloom) and T5's relative
    buckets have no rotary frequencies to rescale."""
    rope_scaling = rope_scaling_of(source)
    if rope_scaling is None:
        return spec.max_seq_len
    canonical = _rope_scaling(rope_scaling)
    if spec.position != "rope":
        raise InvalidConfigError(f"--rope-scaling rescales rotary position embeddings; {spec.id} has {spec.position} "
                                 f"positions: drop --rope-scaling (at most {spec.max_seq_len} tokens)")
    if reason := _unscalable_rope(spec):
        raise InvalidConfigError(f"--rope-scaling {reason}: drop --rope-scaling (at most {spec.max_seq_len} tokens)")
    return int(spec.max_seq_len * float(canonical.split(":")[1]))


def check_context(spec: Any, seq_len: int, source: Any = None) -> None:
    """``seq_len`` within the model's context limit (``planner.config.context_limit``, with the RoPE scaling
    ``source`` gives: a configuration, a search space or the options), or the one-line error with the fix
    (every command's wording)."""
    limit = context_limit(spec, source)
    if seq_len > limit:
        # a RoPE model reaches it by scaling its rotary frequencies: the smallest whole factor that does
        # (LLaMA-Factory's rule, model/model_utils/rope.py l.63: ceil(cutoff_len / max_position_embeddings))
        hint = (f", or extend its RoPE context: --rope-scaling {-(-seq_len // spec.max_seq_len)}"
                if spec.position == "rope" and not _unscalable_rope(spec) and rope_scaling_of(source) is None else "")
        raise InvalidConfigError(f"--seq-len {seq_len} is longer than {spec.id} allows ({limit}): use at most {limit}{hint}")


def _check_eval(fields: dict[str, Any]) -> None:
    """The evaluation settings: counts, and an eval batch wherever the others are given."""
    for name in ("eval_batch", "eval_seq_len"):
        if fields[name] is not None:
            _check_count(name, fields[name])
    tokens = fields["generate_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= _UPPER_BOUNDS["generate_tokens"]:
        raise InvalidConfigError(f"--generate-tokens must be a whole number from 0 to {_UPPER_BOUNDS['generate_tokens']:,}, "
                                 f"got {tokens!r}")
    if fields["eval_batch"] is None:
        given = "--eval-seq-len" if fields["eval_seq_len"] is not None else "--generate-tokens"
        raise InvalidConfigError(f"{given} describes the evaluation pass: give --eval-batch N too (the HF Trainer's "
                                 "per_device_eval_batch_size, 8 by default)")


def _check_in_bwd_accumulation(grad_accum: int) -> None:
    """torchtune steps the optimizer in every backward under ``optimizer_in_bwd`` and refuses
    accumulation with it (recipes/full_finetune_single_device.py ``__init__`` raises RuntimeError)."""
    if grad_accum > 1:
        raise InvalidConfigError(f"--optimizer-in-bwd steps the optimizer in every backward: torchtune refuses "
                                 f"gradient accumulation with it: use --grad-accum 1 (got {grad_accum})")


def _check_fp8(config: "TrainConfig") -> None:
    """What fp8 (torchao's float8 linears under accelerate) is planned with: full fine-tuning on one
    GPU or DDP replicas. LoRA would convert peft's adapters and the frozen base layers alike
    (torchao's ``convert_to_float8_training`` swaps every ``nn.Linear`` the filter passes, lora_A and
    lora_B included), QLoRA's ``Linear4bit`` has no float8 path, DeepSpeed casts the model itself,
    and FSDP2's float8 all-gather (accelerate's default ``enable_fsdp_float8_all_gather``) shards
    fp8 weights: none of them is modelled."""
    if config.method is not _FULL:
        raise UnsupportedError(f"--precision fp8 with --method {config.method} is not modelled (torchao would convert "
                               "peft's adapters and the frozen base alike): use --method full, or bf16-mixed")
    if not config.sharding.spec.replicas:
        raise UnsupportedError(f"--precision fp8 with {config.sharding.label() or config.sharding.scheme} is not modelled "
                               "(DeepSpeed casts the model itself; FSDP2 gathers fp8 weights): use DDP (no --zero), "
                               "or bf16-mixed")


def _sharding(sharding: Any, zero: Any, offload: Any) -> Sharding:
    """The ``Sharding`` of a construction: ``sharding`` (a value or a scheme's name), with the
    scheme ``--zero`` names when ``zero`` is given and the ``offload`` when given (the old spelling
    of payloads of versions 1 and 2, of the CLI's options and the API's body)."""
    base = sharding if isinstance(sharding, Sharding) else Sharding(sharding)
    if zero is None and offload is None:
        return base
    off = base.offload if offload is None else offload
    named = from_zero(zero, off) if zero is not None else Sharding(base.scheme, off)
    # a user's file's buffer keys (``Sharding.buffers``) stay with the scheme that file names
    if base.buffers is not None and named.scheme is base.scheme:
        return Sharding(named.scheme, named.offload, base.buffers)
    return named


def _lora_fields(lora_r: Any, lora_targets: Any) -> tuple[int, tuple[str, ...]]:
    """The LoRA rank and targets of a LoRA/QLoRA configuration, defaulted and checked."""
    r = DEFAULT_LORA_R if lora_r is None else lora_r
    if type(r) is int and 0 < r <= _UPPER_BOUNDS["lora_r"]:
        pass  # the common case
    elif isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidConfigError(f"--lora-r must be a whole number >= 1, got {r!r}")
    elif r > _UPPER_BOUNDS["lora_r"]:
        raise InvalidConfigError(f"--lora-r {r} is beyond any adapter (at most {_UPPER_BOUNDS['lora_r']:,}): use e.g. 16")
    targets = DEFAULT_LORA_TARGETS if lora_targets is None else lora_targets
    if type(targets) is not tuple:  # a tuple is kept as it is (the common case)
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        targets = tuple(targets)
    if not targets:
        raise InvalidConfigError("--lora-targets is empty: give all-linear or module names like q_proj,v_proj")
    if ALL_LINEAR in targets and len(targets) > 1:
        raise InvalidConfigError("--lora-targets: all-linear cannot be combined with names")
    return r, targets


#: The enum-valued fields of ``TrainConfig``, in the order they are checked, with their types.
_ENUM_FIELDS = (("method", Method), ("precision", Precision), ("optimizer", Optimizer), ("attention", Attention),
                ("loop", Loop))
#: The count fields of ``TrainConfig``, in the order they are checked, with their bounds.
_COUNT_BOUNDS = tuple((name, _UPPER_BOUNDS[name]) for name in ("micro_batch", "seq_len", "grad_accum", "gpus", "loss_chunks"))
#: The members ``TrainConfig``'s checks compare with, bound once: reading a member through its class
#: goes through ``EnumType.__getattr__``'s slow attribute path on CPython 3.11 (~0.3 us a read).
_FULL = Method.FULL
_QLORA = Method.QLORA
_FP32 = Precision.FP32
_FLASH = Attention.FLASH
_FP8 = Precision.FP8
#: ``Precision.is_mixed`` and ``Precision.weight_bytes``' members, bound once for the same reason (the
#: search reads them thousands of times a search)
_MIXED = frozenset({Precision.FP16_MIXED, Precision.BF16_MIXED, Precision.FP8})
_FP32_WEIGHTS = frozenset({Precision.FP32, Precision.FP16_MIXED, Precision.BF16_MIXED, Precision.FP8})
#: The copy constructors make an instance and give it its fields' dict at once, as ``__init__``
#: does (``object.__setattr__`` because the dataclass is frozen).
_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True, kw_only=True, init=False)
class TrainConfig:
    """One fully specified fine-tuning configuration (per device unless said otherwise)."""

    method: Method = Method.FULL
    """full fine-tuning, LoRA (peft) or QLoRA (4-bit NF4 base weights + LoRA)."""
    precision: Precision = Precision.BF16_MIXED
    """Numeric precision; see ``Precision``."""
    optimizer: Optimizer = Optimizer.ADAMW
    """An optimizer of the registry, by name (``planner.optim``: one descriptor module each)."""
    micro_batch: int = 1
    """Sequences per forward/backward on one device."""
    seq_len: int = 512
    """Tokens per sequence (padded length)."""
    grad_accum: int = 1
    """Micro-steps accumulated before each optimizer step."""
    gpus: int = 1
    """Data-parallel devices (the ranks ``sharding`` spreads the model states over)."""
    grad_ckpt: bool = False
    """Gradient (activation) checkpointing per decoder layer, non-reentrant."""
    attention: Attention = Attention.SDPA
    """Attention implementation (transformers' attn_implementation)."""
    lora_r: int | None = None
    """LoRA rank; only for lora/qlora (default 16 there)."""
    lora_targets: tuple[str, ...] | None = None
    """Module names LoRA adapts, or ("all-linear",); only for lora/qlora."""
    sharding: Sharding = NONE
    """How the model states are spread over the ``gpus`` ranks, and what of them the host holds
    (``planner.sharding``: none/DDP, DeepSpeed ZeRO-1/2/3, each with its offloads). Whole replicas
    are DDP on more than one GPU (``planner.sharding.for_gpus``). Given as a value or a scheme's
    name; ``zero`` and ``offload`` (the CLI's ``--zero N --offload X``, payloads of versions 1 and
    2) make it too."""
    alloc_conf: str | None = None
    """PyTorch's CUDA caching allocator settings as ``PYTORCH_CUDA_ALLOC_CONF`` takes them, e.g.
    ``max_split_size_mb:128,expandable_segments:True`` (None: PyTorch's defaults). Stored in a
    canonical spelling; the memory model replays the allocator with them."""
    lora_dropout: float = 0.0
    """PEFT's ``LoraConfig.lora_dropout``; only for lora/qlora. With p > 0 each adapted module runs
    its input through its own ``nn.Dropout`` (peft/tuners/lora/layer.py ``update_layer``: Identity
    when p == 0) and keeps the mask (and, where lora_A does not save a cast of it, the dropped copy)
    for backward."""
    loop: Loop = Loop.TRAINER
    """HF Trainer (the outputs die at the loss) or a hand-written loop (they live through backward)."""
    fused_ce: bool = False
    """A fused linear cross-entropy (Liger's ``LigerFusedLinearCrossEntropyLoss``): the lm_head and
    the loss run chunk by chunk, the logits are never materialised and the head's gradients are
    computed in the forward."""
    packing: bool = True
    """Sequences packed to the full ``seq_len`` (no padding, no attention mask; the model's
    assumption so far). False: padded to the longest of the batch; the peak is the batch whose
    longest sequence is ``seq_len``, with the attention mask transformers builds for the padding."""
    use_cache: bool = False
    """transformers' ``use_cache`` in the training forward: True builds a ``DynamicCache`` (K and V
    of every layer) that lives as long as the outputs. The HF Trainer sets
    ``model.config.use_cache = args.use_cache`` (False by default, transformers/trainer.py);
    checkpointing turns it off (transformers/utils/generic.py, ``use_cache=True`` is incompatible
    with gradient checkpointing), so it costs nothing with ``grad_ckpt``."""
    optimizer_in_bwd: bool = False
    """torchtune's ``optimizer_in_bwd``: one optimizer per parameter, stepped by a
    post-accumulate-grad hook that then frees the gradient (recipes/full_finetune_single_device.py
    ``_setup_optimizer``), so only the largest tensor's gradient is alive. Its recipe refuses
    gradient accumulation with it (``__init__``: "Gradient accumulation is not supported with
    optimizer in bwd"); its LoRA recipe has no such key (lora_finetune_single_device.py)."""
    loss_chunks: int = 1
    """A cross-entropy over this many pieces of the logits along the sequence, each upcast alone
    (torchtune's ``CEWithChunkedOutputLoss``: ``num_output_chunks``); 1: the whole logits at once."""
    loss_upcast: bool = True
    """The cross-entropy upcasts the logits to fp32 first (transformers' ``ForCausalLMLoss``:
    ``logits = logits.float()``, transformers 5.24 loss/loss_utils.py:61); False: it runs on them in
    the head's dtype (litgpt's ``chunked_cross_entropy``), so its log-probabilities and gradients are
    16-bit (``planner.memory.activations.log_softmax_bytes``). Refused with ``fused_ce``, whose loss
    is Liger's own."""
    loss_shift: bool = False
    """The causal-LM loss as transformers <= 4.45 computes it in the model's forward
    (``planner.memory.activations.shifted_loss``): the logits upcast and returned, a contiguous copy of
    all but each sequence's last position, ``CrossEntropyLoss`` on that copy, and in backward a
    zero-filled gradient of the whole logits (transformers 4.45.2 models/mistral/modeling_mistral.py
    l.1059-1074); False: transformers 5's ``ForCausalLMLoss`` (the labels shifted, not the logits).
    Refused with ``fused_ce`` and ``loss_chunks``, whose losses are their own."""
    loss_returns_head: bool = False
    """With ``loss_shift``: transformers 4.46-4.48's causal-LM loss, which the model's forward still
    runs on a shifted contiguous copy of the fp32 logits, but the model returns the head's own 16-bit
    logits and ``ForCausalLMLoss`` upcasts them (4.48.1 models/mistral/modeling_mistral.py l.848-852,
    loss/loss_utils.py l.36-47), so the head's output is alive beside the upcast, its copy and the
    log-probabilities until the outputs die (``planner.memory.activations.shifted_loss``); the copy went
    with transformers PR #35646, after 4.48.1. Refused without ``loss_shift``."""
    reentrant_ckpt: bool = False
    """Gradient checkpointing as transformers 4 runs it: the model's loop calls each decoder layer inside a
    reentrant checkpoint (4.45.2 models/mistral/modeling_mistral.py l.805-806, modeling_utils.py l.2404),
    around the layer's FSDP1 unit, which then keeps each frozen layer's input gradient to the end of
    backward (``planner.sharding.fsdp1.retained_input_gradients``); False: transformers 5's checkpoint
    inside the layer, or a non-reentrant one (the planner's own runs)."""
    experts_loop: bool = False
    """MoE experts as transformers 4 builds and runs them (Mixtral: an nn.ModuleList of per-expert nn.Linear
    w1/w3/w2 looped over in Python, 4.48.1 models/mixtral/modeling_mixtral.py l.67-150): the model is planned with
    ``planner.memory.moe.per_expert_layout`` (4-bit experts under QLoRA, all-linear adapting w1/w2/w3, the loop's
    saved tensors and eager ops); False: transformers 5's fused expert stacks run by grouped_mm."""
    experts_list_index: bool = False
    """With ``experts_loop``: the loop as transformers 4.36-4.39 wrote it, which copies each expert's routed token
    indices to the host and indexes the hidden states and routing weights with them as Python lists (4.39.3
    models/mixtral/modeling_mixtral.py l.866-877: ``top_x.tolist()``, ``hidden_states[None, top_x_list]``); 4.40
    indexes with the tensors (``planner.moe_loop.list_index_host_seconds``). Refused without ``experts_loop``."""
    rope_caches: bool = False
    """Each attention layer keeps cos and sin tables of max_position_embeddings x head_dim in the load dtype, as
    transformers up to 4.40 (Llama), 4.41 (Mistral), 4.44 (Qwen2) and 4.47 (Mixtral) built its rotary embeddings
    (``planner.memory.buffers``); False: transformers 5's one inv_freq, cos and sin made per forward."""
    compile: bool = False
    """The model run under torch.compile (Inductor, mode "default": no CUDA graphs): the elementwise work between
    GEMMs and attention is priced as Inductor's fused kernels (``planner.kernels.compiled_block_forward_bytes``,
    ``compiled_kernels_per_micro_step``); the memory is eager's saved tensors, a bound (``planner.throughput``
    says so in its assumptions). False: eager PyTorch, one kernel per op."""
    kbit_upcast: bool = True
    """QLoRA's k-bit preparation upcasts every non-4-bit parameter to fp32 (peft's
    ``prepare_model_for_kbit_training``, peft 0.21 utils/other.py:204-209: norms, embeddings, the
    head), so the residual stream is fp32 (``planner.memory.dtypes.dtype_mode``); False: they stay in
    the 16-bit compute dtype they were loaded in (fms-acceleration's accelerated-peft-bnb, torchtune's
    QLoRA recipes, LLaMA-Factory, axolotl: ``planner.request``'s note). Only QLoRA takes False."""
    eval_batch: int | None = None
    """Evaluation during training (the HF Trainer's ``per_device_eval_batch_size`` with an
    ``eval_strategy``): sequences per eval forward; None: the run does not evaluate. The eval pass
    runs after an optimizer step, with the gradients freed (``planner.memory.evaluation``)."""
    eval_seq_len: int | None = None
    """Tokens per eval sequence (the prompt, under ``generate_tokens``); None: ``seq_len``."""
    generate_tokens: int = 0
    """Tokens each eval sequence generates (``model.generate(max_new_tokens=N)``, the KV cache on:
    Seq2SeqTrainer's ``predict_with_generate``, a generating eval callback); 0: no generation."""
    rope_scaling: str | None = None
    """RoPE context extension, ``TYPE:FACTOR`` (``ROPE_TYPES``; given as FACTOR it is linear's): the
    model's context limit times FACTOR (``context_limit``). No memory or time term reads it (the
    scaling changes the rotary tables' values only: ``planner.request``'s note); None: no scaling."""

    def __init__(self, *, method: Method | str = Method.FULL, precision: Precision | str = Precision.BF16_MIXED,
                 optimizer: Optimizer | str = Optimizer.ADAMW, micro_batch: int = 1, seq_len: int = 512,
                 grad_accum: int = 1, gpus: int = 1, grad_ckpt: bool = False, attention: Attention | str = Attention.SDPA,
                 lora_r: int | None = None, lora_targets: tuple[str, ...] | str | None = None,
                 sharding: Sharding | str = NONE, alloc_conf: str | None = None, lora_dropout: float = 0.0,
                 loop: Loop | str = Loop.TRAINER, fused_ce: bool = False, packing: bool = True,
                 use_cache: bool = False, optimizer_in_bwd: bool = False, loss_chunks: int = 1,
                 loss_upcast: bool = True, loss_shift: bool = False, loss_returns_head: bool = False, reentrant_ckpt: bool = False, experts_loop: bool = False, experts_list_index: bool = False, rope_caches: bool = False, compile: bool = False, kbit_upcast: bool = True, eval_batch: int | None = None, eval_seq_len: int | None = None, generate_tokens: int = 0, rope_scaling: str | None = None, zero: int | None = None, offload: Offload | str | None = None) -> None:
        # The dataclass's own __init__ with every field and its default (a test holds them equal),
        # setting all fields at once: the generated one makes one object.__setattr__ call per frozen
        # field, half the cost of a construction (the search makes hundreds per request). ``zero``
        # and ``offload`` are not fields: the old spelling of ``sharding`` (see ``_sharding``).
        _set(self, "__dict__", {
            "method": method, "precision": precision, "optimizer": optimizer, "micro_batch": micro_batch,
            "seq_len": seq_len, "grad_accum": grad_accum, "gpus": gpus, "grad_ckpt": grad_ckpt,
            "attention": attention, "lora_r": lora_r, "lora_targets": lora_targets, "sharding": sharding,
            "alloc_conf": alloc_conf, "lora_dropout": lora_dropout, "loop": loop, "fused_ce": fused_ce,
            "packing": packing, "use_cache": use_cache, "optimizer_in_bwd": optimizer_in_bwd,
            "loss_chunks": loss_chunks, "loss_upcast": loss_upcast, "loss_shift": loss_shift, "loss_returns_head": loss_returns_head, "reentrant_ckpt": reentrant_ckpt, "experts_loop": experts_loop, "experts_list_index": experts_list_index, "rope_caches": rope_caches, "compile": compile, "kbit_upcast": kbit_upcast, "eval_batch": eval_batch, "eval_seq_len": eval_seq_len,
            "generate_tokens": generate_tokens, "rope_scaling": rope_scaling,
        })
        self.__post_init__(zero, offload)

    def __post_init__(self, zero: int | None = None, offload: Offload | str | None = None) -> None:
        # Every check, in the order the errors are given (a configuration with two mistakes is
        # told of the first). Fast on valid input: the search builds hundreds of these per
        # request, and most values arrive as the right type.
        self._check_fields(zero, offload)
        self._check_adapters()
        self._check_combination()

    def _check_fields(self, zero: int | None, offload: Offload | str | None) -> None:
        """Each field on its own: enums coerced from their spelling, flags, counts, the sharding
        (from ``zero``/``offload`` where given), the allocator settings. (Fields are written to
        ``__dict__`` as ``object.__setattr__`` would write them, at a fraction of its cost.)"""
        fields = self.__dict__
        # each group's common case first, in one test: the search builds hundreds of these
        if not (type(fields["method"]) is Method and type(fields["precision"]) is Precision
                and type(fields["optimizer"]) is Optimizer and type(fields["attention"]) is Attention
                and type(fields["loop"]) is Loop and (offload is None or type(offload) is Offload)):
            for name, enum_type in _ENUM_FIELDS:
                if name == "loop" and offload is not None:  # the offload's spelling is told of first
                    offload = choice(Offload, offload, "offload")
                if type(fields[name]) is not enum_type:  # a member is of its class exactly
                    fields[name] = choice(enum_type, fields[name], name)
        dropout = fields["lora_dropout"]
        if type(dropout) is not float or not 0.0 <= dropout < 1.0:
            fields["lora_dropout"] = _check_dropout(dropout)
        if not (type(fields["fused_ce"]) is bool and type(fields["packing"]) is bool  # bool has no subclasses
                and type(fields["use_cache"]) is bool and type(fields["optimizer_in_bwd"]) is bool
                and type(fields["kbit_upcast"]) is bool and type(fields["loss_upcast"]) is bool
                and type(fields["loss_shift"]) is bool and type(fields["loss_returns_head"]) is bool
                and type(fields["reentrant_ckpt"]) is bool
                and type(fields["experts_loop"]) is bool and type(fields["experts_list_index"]) is bool
                and type(fields["rope_caches"]) is bool and type(fields["compile"]) is bool):
            flag = next(flag for flag in ("fused_ce", "packing", "use_cache", "optimizer_in_bwd", "kbit_upcast",
                                          "loss_upcast", "loss_shift", "loss_returns_head", "reentrant_ckpt", "experts_loop",
                                          "experts_list_index", "rope_caches", "compile")
                        if type(fields[flag]) is not bool)
            raise InvalidConfigError(f"{flag} must be true or false, got {fields[flag]!r}")
        for name, bound in _COUNT_BOUNDS:
            value = fields[name]
            if type(value) is not int or not 0 < value <= bound:  # else _check_count passes it
                _check_count(name, value)
        if fields["eval_batch"] is not None or fields["eval_seq_len"] is not None or fields["generate_tokens"]:
            _check_eval(fields)
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = _rope_scaling(fields["rope_scaling"])
        sharding = fields["sharding"]
        if not isinstance(sharding, Sharding) or zero is not None or offload is not None:
            sharding = _sharding(sharding, zero, offload)
        fields["sharding"] = for_gpus(sharding, fields["gpus"]) if sharding.spec.replicas else sharding
        if fields["alloc_conf"] is not None:
            from planner.memory.allocator import AllocatorConfig

            fields["alloc_conf"] = AllocatorConfig.parse(fields["alloc_conf"]).spelling() or None

    def _check_adapters(self) -> None:
        """LoRA's rank and targets defaulted and checked for LoRA/QLoRA; refused for full
        fine-tuning."""
        if self.method is _FULL:
            # the options given, by name: the API names the first as the request's field
            given = [name for name, value in (("--lora-r", self.lora_r), ("--lora-targets", self.lora_targets),
                                              ("--lora-dropout", self.lora_dropout or None)) if value is not None]
            if given:
                raise InvalidConfigError(
                    f"{'/'.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to LoRA: use --method lora or "
                    f"qlora, or drop {'it' if len(given) == 1 else 'them'}"
                )
        else:
            fields = self.__dict__
            fields["lora_r"], fields["lora_targets"] = _lora_fields(fields["lora_r"], fields["lora_targets"])

    def _check_combination(self) -> None:
        """Fields that exclude each other, the sharding scheme's last (``ShardingSpec.check``)."""
        self._check_pairs()
        self.sharding.spec.check(self, self.sharding.offload)

    def _check_pairs(self) -> None:
        """``_check_combination``'s checks before the sharding scheme's own.
        Each condition reads its int or bool field first: an enum member read through its class
        costs ~0.3 us on CPython 3.11 (``EnumType`` has a ``__getattr__``)."""
        if self.attention is _FLASH and self.precision is _FP32:
            raise InvalidConfigError(
                "--attention flash needs fp16 or bf16 compute (flash-attn has no fp32 kernel): "
                "use --attention sdpa or a 16-bit --precision"
            )
        if self.fused_ce and self.method is _FULL:
            raise UnsupportedError(
                "--fused-ce with --method full is not modelled (the fused loss makes the trained head's "
                "gradient in the forward): use --method lora or qlora, or drop --fused-ce"
            )
        if self.fused_ce and not self.loss_upcast:
            raise InvalidConfigError("--no-loss-upcast sets the dtype of a cross-entropy on the logits, which --fused-ce "
                                     "never materialises (Liger's fused loss is fp32 inside): drop one")
        if self.loss_shift and (self.fused_ce or self.loss_chunks > 1):
            raise InvalidConfigError(f"--loss-shift is transformers 4's cross-entropy on a shifted copy of the whole "
                                     f"logits; {'--fused-ce' if self.fused_ce else '--loss-chunks'} is a loss of its "
                                     "own: drop one")
        if self.experts_list_index and not self.experts_loop:
            raise InvalidConfigError("--experts-list-index is transformers 4.36-4.39's per-expert MoE loop indexed with "
                                     "Python lists: add --experts-loop, or drop it")
        if self.loss_returns_head and not self.loss_shift:
            raise InvalidConfigError("--loss-returns-head is transformers 4.46-4.48's loss on a shifted copy of the "
                                     "logits with the head's own logits returned: add --loss-shift, or drop it")
        if self.fused_ce and self.eval_batch is not None:
            raise UnsupportedError(
                "--eval-batch with --fused-ce is not modelled (Liger's eval forward skips the logits only under "
                "prediction_loss_only, and returns them to generate): drop one of them"
            )
        if self._torchtune_set:
            self._check_torchtune()
        if not self.kbit_upcast and self.method is not _QLORA:
            raise InvalidConfigError(f"--no-kbit-upcast describes QLoRA's k-bit preparation (the 4-bit base's other "
                                     f"parameters); --method {self.method} has none: use --method qlora or drop it")
        sharding = self.sharding
        if self.precision is _FP8:
            _check_fp8(self)
        if self.fused_ce and sharding.spec.partial_head:
            # the scheme holds only a partition of the head's weight where the fused loss reads it
            raise UnsupportedError(sharding.spec.partial_head)

    @property
    def _torchtune_set(self) -> bool:
        return self.optimizer_in_bwd or self.loss_chunks > 1

    def _check_torchtune(self) -> None:
        """torchtune's recipe settings with what they cannot go with."""
        if self.optimizer_in_bwd:
            _check_in_bwd_accumulation(self.grad_accum)
            if self.method is not _FULL:
                raise InvalidConfigError("--optimizer-in-bwd is torchtune's full fine-tuning setting (its LoRA recipe "
                                         "has none): use --method full or drop it")
            if self.gpus > 1 or self.sharding != NONE:
                raise UnsupportedError("--optimizer-in-bwd is modelled on one device (torchtune's "
                                       "full_finetune_single_device recipe): drop the sharding and use --gpus 1")
        if self.loss_chunks > 1 and self.fused_ce:
            raise InvalidConfigError("--loss-chunks splits the logits, which --fused-ce never materialises: drop one")

    # ---- derived -------------------------------------------------------------------------
    @property
    def zero(self) -> int | None:
        """The ``--zero`` stage of the sharding (0: no DeepSpeed; None: a scheme no stage names)."""
        return self.sharding.spec.zero_stage

    @property
    def offload(self) -> Offload:
        """What of the model states the host holds (``Sharding.offload``)."""
        return self.sharding.offload

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.gpus

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def builds_kv_cache(self) -> bool:
        """The training forward builds a KV cache: ``use_cache`` without checkpointing."""
        return self.use_cache and not self.grad_ckpt

    @property
    def full_logits(self) -> bool:
        """The step holds the whole micro-batch's logits (b x s x vocab): not under the fused loss,
        whose chunk loop never makes them."""
        return not self.fused_ce

    @property
    def evaluates(self) -> bool:
        """The run has an eval pass (``eval_batch``)."""
        return self.eval_batch is not None

    @property
    def eval_tokens(self) -> int:
        """Tokens per eval sequence: the prompt's (``eval_seq_len``, else ``seq_len``)."""
        return self.eval_seq_len or self.seq_len

    @property
    def lora_all_linear(self) -> bool:
        return self.lora_targets == (ALL_LINEAR,)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def with_split(self, *, micro_batch: int, grad_accum: int, grad_ckpt: bool | None = None) -> "TrainConfig":
        """This configuration with another micro-batch x accumulation split (and optionally
        checkpointing switched). The new values are checked, the accumulation against
        ``optimizer_in_bwd`` too (the one other field ``__post_init__`` reads with them), so the rest
        is not validated again: the search
        and the memory model make tens of thousands of these (``tests/search/test_search_speed_paths.py``
        holds them equal to full constructions over the search's space)."""
        if type(micro_batch) is not int or not 0 < micro_batch <= _UPPER_BOUNDS["micro_batch"]:  # else it passes
            _check_count("micro_batch", micro_batch)
        if type(grad_accum) is not int or not 0 < grad_accum <= _UPPER_BOUNDS["grad_accum"]:
            _check_count("grad_accum", grad_accum)
        if grad_accum > 1 and self.optimizer_in_bwd:
            _check_in_bwd_accumulation(grad_accum)
        fields = self.__dict__.copy()
        fields["micro_batch"] = micro_batch
        fields["grad_accum"] = grad_accum
        if grad_ckpt is not None:
            fields["grad_ckpt"] = bool(grad_ckpt)
        copy = _new(TrainConfig)  # holding ``fields`` as they are: what changed was checked above
        _set(copy, "__dict__", fields)
        return copy

    def with_lora(self, *, lora_r: int, lora_targets: tuple[str, ...]) -> "TrainConfig":
        """This LoRA/QLoRA configuration with another rank and targets, checked as ``__post_init__``
        checks them (no other field reads them): the search makes one per adapter variant."""
        assert self.method is not _FULL, self.method
        fields = self.__dict__.copy()
        fields["lora_r"], fields["lora_targets"] = _lora_fields(lora_r, lora_targets)
        copy = _new(TrainConfig)
        _set(copy, "__dict__", fields)
        return copy

    def with_knobs(self, *, optimizer: Optimizer, sharding: Sharding) -> "TrainConfig":
        """This configuration with another optimizer and sharding, checked as ``__post_init__``
        checks them: each on its own, then the combination checks, the only ones that read them
        with another field (the search validates the optimizers and shardings of each method and
        precision by copying one construction; ``tests/search/test_search_speed_paths.py`` holds them
        equal to full constructions and refused where those are)."""
        copy = self._knobs_copy(optimizer, sharding)
        copy._check_combination()
        return copy

    def taken_knobs(self, *, optimizer: Optimizer, sharding: Sharding) -> TrainConfig | None:
        """``with_knobs``, or None where the sharding scheme refuses the combination
        (``ShardingSpec.refusal``: the search asks about every optimizer and sharding of a method
        and precision, and schemes refuse hundreds of them a search; raising each was 2% of it).
        The checks before the scheme's raise as ``with_knobs``' do."""
        copy = self._knobs_copy(optimizer, sharding)
        copy._check_pairs()
        sharding = copy.sharding
        return None if sharding.spec.refusal(copy, sharding.offload) is not None else copy

    def _knobs_copy(self, optimizer: Optimizer, sharding: Sharding) -> TrainConfig:
        """This configuration with another optimizer and sharding, each checked on its own."""
        fields = self.__dict__.copy()
        fields["optimizer"] = optimizer if type(optimizer) is Optimizer else choice(Optimizer, optimizer, "optimizer")
        if not isinstance(sharding, Sharding):
            sharding = Sharding(sharding)
        fields["sharding"] = for_gpus(sharding, fields["gpus"]) if sharding.spec.replicas else sharding
        copy = _new(TrainConfig)
        _set(copy, "__dict__", fields)
        return copy

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with the CLI's option names as keys (underscored), and the
        payload's ``version`` (``CONFIG_VERSION``; version 2 where a ``--zero`` stage names the
        sharding)."""
        sharding = self.sharding.payload()
        return {
            # torchtune's settings are version 3's: a version-2 reader would drop them
            "version": _ZERO_PAYLOAD_VERSION if "zero" in sharding and not self._torchtune_set and self.kbit_upcast
            and self.loss_upcast and not self.loss_shift and not self.loss_returns_head and not self.reentrant_ckpt and not self.experts_loop and not self.experts_list_index and not self.rope_caches and not self.compile
            and not self.rope_scaling
            else CONFIG_VERSION,
            "method": str(self.method),
            "precision": str(self.precision),
            "optimizer": str(self.optimizer),
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "grad_accum": self.grad_accum,
            "gpus": self.gpus,
            "grad_ckpt": self.grad_ckpt,
            "attention": str(self.attention),
            "lora_r": self.lora_r,
            "lora_targets": ",".join(self.lora_targets) if self.lora_targets else None,
            **sharding,
            "alloc_conf": self.alloc_conf,
            "lora_dropout": self.lora_dropout,
            "loop": str(self.loop),
            "fused_ce": self.fused_ce,
            "packing": self.packing,
            "use_cache": self.use_cache,
            # torchtune's settings only where set: a payload without them keeps its bytes
            **({"optimizer_in_bwd": True} if self.optimizer_in_bwd else {}),
            **({"loss_chunks": self.loss_chunks} if self.loss_chunks > 1 else {}),
            # the k-bit preparation only where it does not upcast (peft's, the default, keeps the bytes)
            **({"kbit_upcast": False} if not self.kbit_upcast else {}),
            **({"loss_upcast": False} if not self.loss_upcast else {}),
            **({"loss_shift": True} if self.loss_shift else {}),
            **({"loss_returns_head": True} if self.loss_returns_head else {}),
            **({"reentrant_ckpt": True} if self.reentrant_ckpt else {}),
            **({"experts_loop": True} if self.experts_loop else {}),
            **({"experts_list_index": True} if self.experts_list_index else {}),
            **({"rope_caches": True} if self.rope_caches else {}),
            **({"compile": True} if self.compile else {}),
            # the evaluation settings only where the run evaluates: a payload without them is a
            # run without an eval pass, and keeps its bytes
            **({"eval_batch": self.eval_batch, "eval_seq_len": self.eval_seq_len,
                "generate_tokens": self.generate_tokens} if self.evaluates else {}),
            # only where set: a payload without it keeps its bytes
            **({"rope_scaling": self.rope_scaling} if self.rope_scaling else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = False) -> "TrainConfig":
        """Decode a ``to_dict`` payload of any version: keys it lacks take their defaults; keys
        this code does not know (a newer planner's settings) raise with ``strict``, else are
        ignored with a warning."""
        known = {f.name for f in dataclasses.fields(cls)} | {"zero", "offload"}  # the old sharding keys
        known.add("buffers")  # ``Sharding.payload``'s, read by ``decode`` below
        unknown = set(data) - known - {"version"}
        if unknown and strict:
            raise InvalidConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        if unknown:
            warnings.warn(f"configuration keys this planner does not know are ignored: {', '.join(sorted(unknown))}",
                          stacklevel=2)
        kept = {k: v for k, v in data.items() if k in known and k != "buffers"}
        if data.get("buffers") is not None:  # a user's file's buffer keys: the sharding decoded whole
            from planner.sharding import decode

            kept.update(sharding=decode(data), zero=None, offload=None)
        return cls(**kept)

    def label(self) -> str:
        """Short human description, e.g. ``lora r16 all-linear, bf16-mixed, adamw, mb4x8, ckpt``."""
        parts = [str(self.method)]
        if self.method.uses_adapters:
            parts[0] += f" r{self.lora_r} {','.join(self.lora_targets or ())}"
        parts += [str(self.precision), str(self.optimizer)]
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}" + (f"x{self.gpus}gpu" if self.gpus > 1 else ""))
        if self.grad_ckpt:
            parts.append("ckpt")
        sharding = self.sharding.label()
        if sharding:
            parts.append(sharding)
        if self.attention is not Attention.SDPA:
            parts.append(str(self.attention))
        if self.alloc_conf:
            parts.append(f"alloc {self.alloc_conf}")
        if self.lora_dropout:
            parts.append(f"dropout {self.lora_dropout:g}")
        if self.loop is not Loop.TRAINER:
            parts.append(f"{self.loop} loop")
        if self.fused_ce:
            parts.append("fused-ce")
        if not self.packing:
            parts.append("padded")
        if self.builds_kv_cache:
            parts.append("use_cache")
        if self.optimizer_in_bwd:
            parts.append("optim-in-bwd")
        if self.loss_chunks > 1:
            parts.append(f"loss/{self.loss_chunks}")
        if not self.loss_upcast:
            parts.append("16-bit loss")
        if self.loss_shift:
            parts.append("shifted-logits loss" + (", head's logits returned" if self.loss_returns_head else ""))
        if self.reentrant_ckpt:
            parts.append("reentrant ckpt")
        if self.experts_loop:
            parts.append("per-expert loop" + (", list-indexed" if self.experts_list_index else ""))
        if self.rope_caches:
            parts.append("rotary tables per layer")
        if self.compile:
            parts.append("compiled")
        if not self.kbit_upcast:
            parts.append("no-kbit-upcast")
        if self.evaluates:
            parts.append(f"eval b{self.eval_batch}x{self.eval_tokens}"
                         + (f"+gen{self.generate_tokens}" if self.generate_tokens else ""))
        if self.rope_scaling:
            kind, factor = self.rope_scaling.split(":")
            parts.append(f"rope {kind} x{factor}")
        return ", ".join(parts)


__all__ = [
    "ALL_LINEAR",
    "CONFIG_VERSION",
    "ROPE_TYPES",
    "Attention",
    "context_limit",
    "rope_scaling_of",
    "Loop",
    "Method",
    "Offload",
    "Optimizer",
    "Precision",
    "Sharding",
    "TrainConfig",
]
