"""``step.line_reads``: configurations the search's batch key (``search._batch_key``, the fields declared
``BATCH`` beside what ``batch_line`` reads of the method, precision and sharding) puts together have
equal batch lines, for every model family, kernel profile and recipe, and the key does merge the
configurations it means to (else the test would prove nothing)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Method, Precision
from planner.gpus import get_gpu
from planner.memory.parameters import trained
from planner.memory.step import batch_line, line_reads
from planner.search import SearchSpace, _batch_key, _combinations
from planner.units import GiB

#: every block shape of the catalog: decoder (llama; gpt2: LayerNorm, dropout, tied head; phi-2: parallel
#: block), MoE (Mixtral's expert loop, Qwen3-MoE's grouped_mm, Llama 4's dense experts and shared expert,
#: DeepSeek-V3's latent attention, Gemma 4's parallel experts), encoder (bert), encoder-decoder (t5),
#: hybrid/recurrent (Qwen3-Next: Gated DeltaNet and gated attention; Nemotron-H: Mamba2 and MoE)
MODELS = ["meta-llama/Llama-2-7b-hf", "gpt2", "microsoft/phi-2", "mistralai/Mixtral-8x7B-v0.1",
          "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-4-Scout-17B-16E-Instruct", "deepseek-ai/DeepSeek-V3",
          "google/gemma-4-26B-A4B", "bert-base-uncased", "t5-large", "Qwen/Qwen3-Next-80B-A3B-Thinking",
          "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"]

#: the recipe settings the per-micro-batch terms read, among them QLoRA without the k-bit upcast (whose
#: pure 16-bit mode is pure bf16 LoRA's, but whose terms are not: ``qlora_as_lora``) and adapter dropout
RECIPES = [{}, {"kbit_upcast": False}, {"lora_dropout": 0.1}, {"lora_dropout": 0.1, "kbit_upcast": False},
           {"loop": "manual", "use_cache": True, "packing": False}, {"fused_ce": True},
           {"eval_batch": 2, "generate_tokens": 8}]


def _lines(model, gpu, gpus: int, recipe: dict):
    """(config, its batch line) of every combination of the space over every precision and sharding
    (one optimizer: the lines read none), without and with checkpointing."""
    space = SearchSpace(cpu_mem_bytes=512 * GiB, precisions=tuple(Precision),
                        optimizers=(SearchSpace().optimizers[0],), lora_ranks=(8, 64), **recipe)
    for base, _ in _combinations(model=model, gpu=gpu, target_batch=4 * gpus, seq_len=128, gpus=gpus, space=space):
        yield base, batch_line(model, base, gpu.kernels, trained(model, base).target_names)


@pytest.mark.parametrize("model_id", MODELS)
def test_configurations_of_one_batch_key_have_equal_lines(model_id):
    model = resolve_model(model_id)
    merged = {"qlora": 0, "full": 0}
    for gpu_name, gpus in (("a10g", 1), ("h100", 2), ("cpu", 1)):
        gpu = get_gpu(gpu_name)
        for recipe in RECIPES:
            if "eval_batch" in recipe and (model.is_encoder_decoder or model.is_encoder):
                continue  # (the eval pass is not modelled for encoder-decoders, generation not for encoders)
            first: dict[tuple, tuple] = {}
            for config, line in _lines(model, gpu, gpus, recipe):
                key = _batch_key(config)
                if key not in first:
                    first[key] = (config, line)
                    continue
                seen, seen_line = first[key]
                assert line == seen_line, (gpu_name, recipe, config.label(), seen.label())
                if seen.method is not config.method:
                    merged["qlora"] += 1
                elif config.method is Method.FULL and (seen.precision, seen.sharding) != (config.precision,
                                                                                          config.sharding):
                    merged["full"] += 1
    # every model merges QLoRA into LoRA (fp32, DeepSpeed's 16-bit model) and full fine-tuning across ZeRO-3 or
    # DeepSpeed's 16-bit model; QLoRA's pure 16-bit model is kept apart from LoRA's
    # (test_qlora_is_kept_apart_where_its_terms_are_not_loras)
    assert merged["qlora"] and merged["full"], merged


def test_qlora_is_kept_apart_where_its_terms_are_not_loras():
    """QLoRA without the k-bit upcast in pure fp16 has pure bf16 LoRA's dtype mode, but bitsandbytes casts
    the adapter output to the base output's dtype before the up projection's sum (fp32 adapters on 16-bit
    projections): its lines differ from LoRA's, and so do the keys; under autocast too."""
    from planner.config import TrainConfig

    model, kernels = resolve_model("meta-llama/Llama-2-7b-hf"), get_gpu("cpu").kernels
    for precision in ("fp16", "bf16-mixed"):
        lora, qlora = (TrainConfig(method=m, precision=precision, lora_r=8, grad_ckpt=True, micro_batch=2,
                                   **({"kbit_upcast": False} if m == "qlora" else {})) for m in ("lora", "qlora"))
        assert line_reads(lora) != line_reads(qlora), precision
        assert (batch_line(model, lora, kernels, trained(model, lora).target_names)
                != batch_line(model, qlora, kernels, trained(model, qlora).target_names)), precision
    # in fp32 the two are one: the same mode, and QLoRA read as LoRA
    lora, qlora = (TrainConfig(method=m, precision="fp32", lora_r=8) for m in ("lora", "qlora"))
    assert line_reads(lora) == line_reads(qlora)
