"""Parameters: which tensors a configuration trains, and how many elements each holds.

Shared with ``planner.throughput`` (adapter FLOPs, traffic) and ``planner.estimation`` (the
``--lora-targets`` check).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from planner.config import ALL_LINEAR, Method, TrainConfig
from planner.errors import InvalidConfigError
from planner.modelspec import LinearSpec, ModelSpec


def lora_targets(model: ModelSpec, config: TrainConfig) -> tuple[LinearSpec, ...]:
    """The per-block linear layers LoRA wraps (peft's "all-linear" skips only the output head)."""
    if not config.method.uses_adapters:
        return ()
    return targeted_linears(model, config.lora_targets)


def targeted_linears(model: ModelSpec, targets: tuple[str, ...] | None) -> tuple[LinearSpec, ...]:
    """The block's linears named by ``targets`` (or all of them for ``all-linear``); unknown
    names are a user error that lists the names the model has."""
    if targets == (ALL_LINEAR,):
        return tuple(model.layer_linears)
    names = set(targets or ())
    available = model.linear_names()
    missing = sorted(names - set(available))
    if missing:
        raise InvalidConfigError(
            f"--lora-targets {','.join(missing)} not found in {model.id}: "
            f"its linear layers are {','.join(available)} (or use all-linear)"
        )
    return tuple(lin for lin in model.layer_linears if lin.name in names)


def lora_params(model: ModelSpec, config: TrainConfig) -> int:
    """LoRA adds A (r x in) and B (out x r) per wrapped linear (per expert copy)."""
    r = config.lora_r or 0
    return model.num_layers * sum(lin.count * r * (lin.in_features + lin.out_features) for lin in lora_targets(model, config))


def trainable_params(model: ModelSpec, config: TrainConfig) -> int:
    """Elements the optimizer updates: every parameter, or the LoRA adapters."""
    if config.method is Method.FULL:
        return model.params_total
    return lora_params(model, config)


def param_tensor_sizes(model: ModelSpec, config: TrainConfig) -> tuple[int, ...]:
    """Element counts of the trainable parameter tensors (for per-tensor optimizer rules)."""
    if config.method.uses_adapters:
        r = config.lora_r or 0
        sizes: list[int] = []
        for lin in lora_targets(model, config):
            sizes += [r * lin.in_features, r * lin.out_features] * lin.count
        return tuple(sizes * model.num_layers)
    sizes = [model.embedding_params]
    if model.other_embedding_params:
        sizes.append(model.other_embedding_params)
    per_layer: list[int] = []
    for lin in model.layer_linears:
        per_layer += [lin.in_features * lin.out_features] * lin.count
        if lin.bias:
            per_layer += [lin.out_features] * lin.count
    # norm weights/biases are tensors of hidden_size (q/k norms of head_dim are smaller still)
    norm = model.layer_norm_params + model.layer_other_params
    while norm > 0:
        per_layer.append(min(norm, model.hidden_size))
        norm -= model.hidden_size
    sizes += per_layer * model.num_layers
    if model.final_norm_params:
        sizes.append(model.final_norm_params)
    if model.head_params:
        sizes.append(model.head_params)
    return tuple(sizes)


def quantized_linear_params(model: ModelSpec) -> int:
    """bitsandbytes quantises every nn.Linear but the output head (get_keys_to_not_convert)."""
    return model.num_layers * model.linear_params_per_layer


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
        return frozenset(lin.name for lin in self.targets)

    @functools.cached_property
    def size_counts(self) -> tuple[tuple[int, int], ...]:
        """(element count, number of tensors of that count): a model has few distinct shapes."""
        return tuple(Counter(self.sizes).items())


def trained(model: ModelSpec, config: TrainConfig) -> Trained:
    return Trained(targets=lora_targets(model, config), count=trainable_params(model, config),
                   sizes=param_tensor_sizes(model, config))


__all__ = [
    "Trained",
    "trained","lora_params", "lora_targets", "param_tensor_sizes", "quantized_linear_params", "targeted_linears",
           "trainable_params"]
