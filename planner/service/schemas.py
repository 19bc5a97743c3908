"""The JSON bodies the API accepts, as pydantic models (their JSON schema is the OpenAPI's).

They check shapes and types only (a field's name and reason on a 422); every value is validated by
the library the CLI calls, so the API and ``planner suggest``/``estimate`` accept the same things.
Types are strict: a number is not a flag (``"fused_ce": 1``) and text is not a number
(``"lora_dropout": "0.1"``; ``true`` was taken as a dropout of 1.0).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from planner.optim import names as optimizer_names
from planner.service.settings import MAX_CONFIG_BYTES

#: a size: bytes as a whole number, or a string with its unit as on the command line ("20GiB")
Size = Optional[Union[StrictInt, StrictStr]]

_SIZE_HELP = "bytes (a whole number) or a size with its unit, e.g. \"20GiB\""


class ModelChoice(BaseModel):
    """Which model on which device: the fields ``suggest`` and ``estimate`` share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        min_length=1, max_length=200, examples=["meta-llama/Llama-2-7b-hf"],
        description="A catalog id (GET /v1/models), or the name to give the inline `config`. "
                    "The server never reads a path or its own caches for a model.",
    )
    config: Optional[dict[str, Any]] = Field(
        default=None, description=f"The model's config.json, inline (at most {MAX_CONFIG_BYTES // 1024} KiB). "
                                  "Only its numbers are read; no code from it ever runs (no trust_remote_code).",
    )
    gpu: str = Field(min_length=1, max_length=64, examples=["a10g"], description="GPU name from GET /v1/gpus, or `cpu`.")
    gpu_mem: Size = Field(default=None, description=f"Override of the device memory: {_SIZE_HELP}.")
    seq_len: Optional[StrictInt] = Field(default=None, description="Tokens per sequence (default: min(2048, the model's maximum)).")
    gpus: StrictInt = Field(default=1, description="Data-parallel devices on one node.")

    @field_validator("config")
    @classmethod
    def _config_size(cls, config: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if config is not None:
            size = len(json.dumps(config, separators=(",", ":"), ensure_ascii=False).encode())
            if size > MAX_CONFIG_BYTES:
                raise ValueError(f"the inline config.json is {size:,} bytes; at most {MAX_CONFIG_BYTES:,} are accepted")
        return config


class RecipeFields(BaseModel):
    """The recipe settings ``planner estimate`` and ``suggest`` take (``TrainConfig``'s fields)."""

    lora_dropout: StrictFloat = Field(default=0.0, description="PEFT's lora_dropout of LoRA/QLoRA (0 <= p < 1).")
    loop: str = Field(default="trainer", max_length=32, description="trainer (HF Trainer: the logits die at the "
                      "loss) | manual (outputs = model(**batch) kept through backward).")
    fused_ce: StrictBool = Field(default=False, description="A fused linear cross-entropy (Liger's): no full logits.")
    packing: StrictBool = Field(default=True, description="Sequences packed to seq_len (false: padded to the longest).")
    use_cache: StrictBool = Field(default=False, description="transformers' use_cache in the training forward.")


class PlanBody(RecipeFields, ModelChoice):
    """``POST /v1/plans``: the request of ``planner suggest``."""

    target_batch: StrictInt = Field(examples=[32], description="Global batch in sequences: micro-batch x accumulation x GPUs.")
    method: str = Field(default="auto", max_length=32, description="auto|full|lora|qlora")
    precision: str = Field(default="auto", max_length=32, description="auto|fp32|fp16-mixed|bf16-mixed|fp16|bf16")
    allow_offload: StrictBool = Field(default=True, description="Consider DeepSpeed CPU offload (false: --no-offload).")
    cpu_mem: Size = Field(default=None, description=f"Host RAM of the node for offload: {_SIZE_HELP} (default: the "
                          "catalog's standard machine with `gpus` of this GPU; where it knows none, offload plans need it).")
    top_k: StrictInt = Field(default=5, description="Plans to keep.")
    prefer: str = Field(default="fidelity", max_length=32, description="Ranking policy: fidelity (the most faithful "
                        "method first, then speed) | speed (the fastest first).")
    fresh: StrictBool = Field(default=False, description="Plan again even when a verified plan of this request is stored.")
    verify: StrictBool = Field(default=False, description="Verify the top candidates with real runs as a Ray job (answers 202).")
    verify_top: StrictInt = Field(default=3, description="With verify: candidates to verify fitting.")
    steps: StrictInt = Field(default=3, description="With verify: optimizer steps per verification run.")


class EstimateBody(RecipeFields, ModelChoice):
    """``POST /v1/estimate``: one fully specified configuration, as ``planner estimate``."""

    method: str = Field(default="full", max_length=32, description="full|lora|qlora")
    precision: Optional[str] = Field(default=None, max_length=32,
                                     description="fp32|fp16-mixed|bf16-mixed|fp16|bf16 (default: the device's mixed precision).")
    optimizer: str = Field(default="adamw", max_length=32, description=optimizer_names())
    micro_batch: StrictInt = Field(default=1, description="Sequences per forward/backward on one device.")
    grad_accum: StrictInt = Field(default=1, description="Micro-steps per optimizer step.")
    grad_ckpt: StrictBool = Field(default=False, description="Gradient checkpointing.")
    attention: str = Field(default="sdpa", max_length=32, description="sdpa|eager|flash")
    lora_r: Optional[StrictInt] = Field(default=None, description="LoRA rank (default: 16 for lora/qlora).")
    lora_targets: Optional[str] = Field(default=None, max_length=1000,
                                        description="all-linear or a comma list of module names (default: all-linear).")
    zero: StrictInt = Field(default=0, description="DeepSpeed ZeRO stage 0|1|2|3.")
    offload: str = Field(default="none", max_length=32, description="none|optimizer|optimizer+params")
    alloc_conf: Optional[str] = Field(default=None, max_length=500, description=(
        "PyTorch CUDA caching allocator settings as PYTORCH_CUDA_ALLOC_CONF takes them, e.g. "
        "max_split_size_mb:128,expandable_segments:True: they change the predicted reserve."))


class FieldError(BaseModel):
    field: str = Field(description="The request field, dotted for nested ones (config.hidden_size).")
    reason: str


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: one line saying what is wrong and how to fix it."""

    error: str = Field(examples=["seq_len 9000 is longer than meta-llama/Llama-2-7b-hf allows (4096): use at most 4096"])
    field: Optional[str] = Field(default=None, description="The request field the error is about, when there is one.")
    errors: Optional[list[FieldError]] = Field(default=None, description="Every field that does not parse (422).")


__all__ = ["EstimateBody", "ErrorBody", "FieldError", "ModelChoice", "PlanBody", "RecipeFields", "Size"]
