"""Parameters: which tensors a configuration trains, and how many elements each holds.

Shared with ``planner.throughput`` (adapter FLOPs, traffic) and ``planner.estimation`` (the
``--lora-targets`` check).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from planner.config import ALL_LINEAR, Method, TrainConfig
from planner.errors import InvalidConfigError
from planner.memo import IdentityMemo
from planner.modelspec import LinearSpec, ModelSpec


def lora_targets(model: ModelSpec, config: TrainConfig) -> tuple[LinearSpec, ...]:
    """The per-block linear layers LoRA wraps (peft's "all-linear" skips only the output head);
    for an encoder-decoder, those of an encoder block followed by those of a decoder block."""
    if not config.method.uses_adapters:
        return ()
    return targeted_linears(model, config.lora_targets)


def _check_names(model: ModelSpec, targets: tuple[str, ...] | None) -> frozenset[str] | None:
    """The target names (None for ``all-linear``); unknown names are a user error that lists
    the names the model has."""
    names = frozenset(targets or ())
    if refused := sorted(names & (set(model.lora_refused) | {ALL_LINEAR})) if model.lora_refused else []:
        raise InvalidConfigError(
            f"--lora-targets {','.join(refused)} fails on {model.model_type}: {model.lora_refused_why}; "
            f"use --lora-targets {','.join(model.peft_linear_names)}"
        )
    if targets == (ALL_LINEAR,):
        return None
    # the modules' leaf names, and the v4 names peft converts to the expert stacks (PEFT_MOE_MAPPING)
    available = tuple(lin for lin in model.linear_names() if lin in model.module_names) \
        + tuple(PEFT_MOE_MAPPING.get(model.peft_converts_moe, {}))
    missing = sorted(names - set(available))
    if missing:
        raise InvalidConfigError(
            f"--lora-targets {','.join(missing)} not found in {model.id}: "
            f"its linear layers are {','.join(dict.fromkeys(available))} (or use all-linear)"
        )
    return names


#: peft's v4 names it maps to the v5 expert stacks and router, by conversion pattern (peft 0.21
#: utils/transformers_weight_conversion.py ``_MOE_TARGET_MODULE_MAPPING``); a target of one of these
#: names becomes a ``target_parameters`` entry and leaves ``target_modules``, so a module of that leaf
#: name (Qwen3-MoE's dense ``down_proj``) is no longer wrapped
PEFT_MOE_MAPPING = {
    "mixtral": {"gate": "gate", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "gate", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}


def _selects(model: ModelSpec, names: frozenset[str] | None) -> "Callable[[LinearSpec], bool]":
    """Whether peft adapts a linear, given the target names (None: ``all-linear``).

    Without conversion (``ModelSpec.peft_converts_moe`` ""), peft wraps the ``nn.Linear`` modules
    named (all of them for ``all-linear``, peft tuners_utils.py ``_maybe_include_all_linear_layers``);
    bare weights are adapted only when named. With it, ``all-linear`` resolves to every module leaf
    name and the mapping's v4 names (``_resolve_string_target_modules``), which then turn into the
    stacks and the router: every bare weight, and no module whose leaf name the mapping holds."""
    mapping = PEFT_MOE_MAPPING.get(model.peft_converts_moe, {})
    if names is None:
        if not model.peft_converts_moe:
            return lambda lin: lin.module
        return lambda lin: not lin.module or lin.name not in mapping
    # target_modules match modules only: a bare weight is reached through the conversion alone
    converted = {mapping[n] for n in names if n in mapping}
    return lambda lin: (lin.module and lin.name in names and lin.name not in mapping) or \
        (not lin.module and lin.name in converted)


def targeted_linears(model: ModelSpec, targets: tuple[str, ...] | None) -> tuple[LinearSpec, ...]:
    """The linears of one block of each kind named by ``targets`` (all of them for
    ``all-linear``). peft matches leaf names, so T5's ``q`` adapts the self-attention and the
    cross-attention (``EncDecAttention``) query alike."""
    return tuple(lin for _, linears in stack_targets(model, targets) for lin in linears)


#: ``stack_targets`` by model and targets: an every-precision search of Llama-2-7b asks ~340 times for a
#: handful of target sets (the adapters' FLOPs, ops, traffic and parameters), and checking the names and
#: selecting the linears took three to four times the lookup's time
_STACK_TARGETS = IdentityMemo(kept=256)


def stack_targets(model: ModelSpec, targets: tuple[str, ...] | None) -> tuple[tuple[int, tuple[LinearSpec, ...]], ...]:
    """(blocks, targeted linears of one block) of each kind of block (``ModelSpec.all_blocks``)."""
    hit = _STACK_TARGETS.get(model, targets)
    if hit is not None:
        return hit
    selects = _selects(model, _check_names(model, targets))  # (refused names raise: never remembered)
    return _STACK_TARGETS.put(model, targets,
                              tuple((n, tuple(lin for lin in linears if selects(lin))) for n, linears in model.all_blocks))


def lora_params(model: ModelSpec, config: TrainConfig) -> int:
    """LoRA adds A (r x in) and B (out x r) per wrapped linear (per expert copy)."""
    if not config.method.uses_adapters:
        return 0
    r = config.lora_r or 0
    return sum(n * sum(lin.count * r * lin.lora_rank * (lin.in_features + lin.out_features) for lin in linears)
               for n, linears in stack_targets(model, config.lora_targets))


def trainable_params(model: ModelSpec, config: TrainConfig) -> int:
    """Elements the optimizer updates: every parameter, or the LoRA adapters."""
    if config.method is Method.FULL:
        return model.params_total
    return lora_params(model, config)


#: ``param_tensor_sizes`` and ``trained`` by model and adapter set (``_adapter_key``): an every-precision
#: search of Llama-2-7b asks about 250 and 60 times (the optimizer step's host dispatch per optimizer,
#: sharding and precision; the shown plans' estimates and timelines) for a handful of adapter sets, and
#: listing a full fine-tuning plan's 291 tensors took far longer than the lookup (py-spy: 2% of a search)
_TENSOR_SIZES = IdentityMemo(kept=256)
_TRAINED = IdentityMemo(kept=256)


def _adapter_key(config: TrainConfig) -> tuple[int | None, tuple[str, ...] | None] | None:
    """What ``param_tensor_sizes`` and ``trained`` read of ``config``: the adapters' rank and targets
    (None for full fine-tuning, which trains every parameter whatever they say)."""
    return (config.lora_r, config.lora_targets) if config.method.uses_adapters else None


def param_tensor_sizes(model: ModelSpec, config: TrainConfig) -> tuple[int, ...]:
    """Element counts of the trainable parameter tensors (for per-tensor optimizer rules), remembered."""
    key = _adapter_key(config)
    hit = _TENSOR_SIZES.get(model, key)
    if hit is None:
        hit = _TENSOR_SIZES.put(model, key, _param_tensor_sizes(model, config))
    return hit


def _param_tensor_sizes(model: ModelSpec, config: TrainConfig) -> tuple[int, ...]:
    """``param_tensor_sizes``, worked out."""
    if config.method.uses_adapters:
        r = config.lora_r or 0
        sizes: list[int] = []
        for n, linears in stack_targets(model, config.lora_targets):
            one: list[int] = []
            for lin in linears:
                if lin.module:
                    one += [r * lin.in_features, r * lin.out_features] * lin.count
                else:  # peft's ParamWrapper: one lora_A (r x experts, in) and one lora_B (out, r x experts)
                    rank = r * lin.lora_rank * lin.count
                    one += [rank * lin.in_features, rank * lin.out_features]
            sizes += one * n
        return tuple(sizes)
    sizes = [model.embedding_params]
    if model.is_encoder_decoder:  # T5: one relative-position table per stack
        sizes += [model.other_embedding_params // 2] * 2
    elif model.other_embedding_params:
        sizes.append(model.other_embedding_params)
    for n, linears, norm in model.block_tensors:
        sizes += _block_tensor_sizes(linears, norm, model.hidden_size) * n
    if model.is_encoder_decoder:  # each stack's final norm
        sizes += _hidden_chunks(model.final_norm_params, model.hidden_size)
    elif model.final_norm_params:
        sizes.append(model.final_norm_params)
    if model.head_params:
        sizes.append(model.head_params)
    return tuple(sizes)


def largest_gradient_elements(t: Trained) -> int:
    """Elements of the largest gradient alive at once when the optimizer steps inside backward:
    torchtune's ``optimizer_in_bwd`` (recipes/full_finetune_single_device.py ``_setup_optimizer``:
    one optimizer per parameter, torchtune/training/memory.py ``register_optim_in_bwd_hooks``:
    ``register_post_accumulate_grad_hook`` runs ``step()`` then ``zero_grad()``, which sets the
    gradient to None) frees each gradient as soon as it is accumulated, so the full gradient set
    never exists: the largest trainable tensor's gradient is the most held (for an untied
    Llama-3 8B, the 128256 x 4096 embedding or head). The recipe refuses gradient accumulation
    with it. ``t``: what the configuration trains (``trained``)."""
    return max(t.sizes, default=0)


def _hidden_chunks(total: int, hidden: int) -> list[int]:
    """Norm weights/biases as tensors of hidden_size (q/k norms of head_dim are smaller still)."""
    return [min(total - start, hidden) for start in range(0, total, hidden)]


def _block_tensor_sizes(linears: tuple[LinearSpec, ...], norm: int, hidden: int) -> list[int]:
    """Element counts of one block's parameter tensors."""
    out: list[int] = []
    for lin in linears:
        out += [lin.in_features * lin.out_features] * lin.count
        if lin.bias:
            out += [lin.out_features] * lin.count
    return out + _hidden_chunks(norm, hidden)


def quantized_linear_params(model: ModelSpec) -> int:
    """bitsandbytes quantises every nn.Linear but the output head (get_keys_to_not_convert); not the
    bare weights (``LinearSpec.module`` False: transformers v5's 3D expert stacks and MoE routers,
    which its bnb integration, integrations/bitsandbytes.py, leaves in the load dtype and
    prepare_model_for_kbit_training then upcasts to fp32 like every other non-4-bit parameter). Their
    weights only: Linear4bit quantises ``weight`` and keeps ``bias`` an ordinary parameter in the load
    dtype (bitsandbytes nn/modules.py Linear4bit: ``self.weight = Params4bit(...)``, the bias nn.Linear's)."""
    return sum(n * sum(lin.count * lin.in_features * lin.out_features for lin in linears if lin.module)
               for n, linears in model.all_blocks)


@dataclass(frozen=True)
class Trained:
    """What a configuration trains, computed once per (method, LoRA rank, targets): the search
    shares one across every optimizer, ZeRO stage and split of the same adapters."""

    targets: tuple[LinearSpec, ...]
    """The linears LoRA wraps (empty for full fine-tuning)."""
    count: int
    """Trainable elements."""
    sizes: tuple[int, ...]
    """Element counts of the trainable tensors."""

    @functools.cached_property
    def target_names(self) -> frozenset[str]:
        return frozenset(lin.key for lin in self.targets)

    @functools.cached_property
    def size_counts(self) -> tuple[tuple[int, int], ...]:
        """(element count, number of tensors of that count): a model has few distinct shapes."""
        return tuple(Counter(self.sizes).items())


def trained(model: ModelSpec, config: TrainConfig) -> Trained:
    """What ``config`` trains, remembered by model and adapter set (``_TRAINED``: a ``Trained`` is
    immutable, its cached properties read its own fields only)."""
    key = _adapter_key(config)
    hit = _TRAINED.get(model, key)
    if hit is None:
        hit = _TRAINED.put(model, key, _trained(model, config))
    return hit


def _trained(model: ModelSpec, config: TrainConfig) -> Trained:
    """``trained``, worked out."""
    return Trained(targets=lora_targets(model, config), count=trainable_params(model, config),
                   sizes=param_tensor_sizes(model, config))


__all__ = ["Trained", "largest_gradient_elements", "lora_params", "lora_targets", "param_tensor_sizes",
           "quantized_linear_params", "stack_targets", "targeted_linears", "trainable_params", "trained"]
