"""``parameters.param_tensor_sizes`` and ``parameters.trained`` remembered by model and adapter set
(``_adapter_key``): every configuration of a search's space gets what working it out afresh gives,
over model families whose tensors differ (tied head, MoE expert stacks, encoder-decoder, hybrid
blocks), and configurations that differ in what is trained never share an entry."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Method, Precision
from planner.gpus import get_gpu
from planner.memory.parameters import _param_tensor_sizes, _trained, param_tensor_sizes, trained
from planner.search import SearchSpace, _combinations, attention_targets
from planner.units import GiB

MODELS = ["meta-llama/Llama-2-7b-hf", "gpt2", "mistralai/Mixtral-8x7B-v0.1", "t5-large",
          "Qwen/Qwen3-Next-80B-A3B-Thinking"]


def _configs(model):
    """Every (method, precision, optimizer, sharding) of the space with two ranks, the adapters'
    also with the attention's projections alone as targets."""
    gpu = get_gpu("h100")
    space = SearchSpace(cpu_mem_bytes=512 * GiB, precisions=(Precision.BF16_MIXED, Precision.FP32), lora_ranks=(8, 64))
    for base, _ in _combinations(model=model, gpu=gpu, target_batch=4, seq_len=128, gpus=2, space=space):
        yield base
        if base.method.uses_adapters:
            yield base.with_lora(lora_r=base.lora_r, lora_targets=attention_targets(model))


@pytest.mark.parametrize("model_id", MODELS)
def test_remembered_equals_worked_out_afresh(model_id):
    model = resolve_model(model_id)
    seen: dict[tuple, tuple] = {}
    methods = set()
    for config in _configs(model):
        methods.add(config.method)
        sizes, t = param_tensor_sizes(model, config), trained(model, config)
        fresh = _trained(model, config)
        assert sizes == _param_tensor_sizes(model, config) == fresh.sizes, config.label()
        assert (t.targets, t.count, t.sizes) == (fresh.targets, fresh.count, fresh.sizes), config.label()
        assert (t.target_names, t.size_counts) == (fresh.target_names, fresh.size_counts), config.label()
        seen[(config.method.uses_adapters, config.lora_r, config.lora_targets)] = (sizes, t.count)
    assert methods == set(Method)
    # the rank and the targets change what is trained: distinct adapter sets, distinct answers
    adapters = [value for (uses, _, _), value in seen.items() if uses]
    assert len(adapters) >= 4 and len(set(adapters)) == len(adapters)


def test_configurations_of_one_adapter_set_share_one_entry():
    model = resolve_model("gpt2")
    full = next(c for c in _configs(model) if c.method is Method.FULL)
    assert trained(model, full) is trained(model, full.replace(precision=Precision.FP32, grad_ckpt=True))
    assert trained(model, full).count == model.params_total
    lora = next(c for c in _configs(model) if c.method is Method.LORA)
    assert param_tensor_sizes(model, lora) is param_tensor_sizes(model, lora.replace(method=Method.QLORA))
