"""The JSON bodies the API accepts, as pydantic models (their JSON schema is the OpenAPI's).

They check shapes and types only (a field's name and reason on a 422); every value is validated by
the library the CLI calls, so the API and ``planner suggest``/``estimate`` accept the same things.
Types are strict: a number is not a flag and text is not a number (``true`` was taken as a dropout
of 1.0). The request's fields are built from their declaration (``planner.request``).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    create_model,
    field_validator,
)

from planner.request import ESTIMATE, FIELDS, RECIPE, SEARCH, RequestField, help_text
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
    seq_len: Optional[StrictInt] = Field(default=FIELDS["seq_len"].default, description=FIELDS["seq_len"].help)
    gpus: StrictInt = Field(default=FIELDS["gpus"].default, description=FIELDS["gpus"].help)

    @field_validator("config")
    @classmethod
    def _config_size(cls, config: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if config is not None:
            size = len(json.dumps(config, separators=(",", ":"), ensure_ascii=False).encode())
            if size > MAX_CONFIG_BYTES:
                raise ValueError(f"the inline config.json is {size:,} bytes; at most {MAX_CONFIG_BYTES:,} are accepted")
        return config


#: the strict pydantic type of each declared field's plain type (a number is not a flag, text is not a number)
_STRICT: dict[type, Any] = {bool: StrictBool, int: StrictInt, float: StrictFloat, str: str}


def _body_fields(fields: "tuple[RequestField, ...]") -> dict[str, Any]:
    """The body's fields of the request's declared ones (``planner.request``): type, default,
    description and the longest text."""
    out: dict[str, Any] = {}
    for f in fields:
        type_ = Optional[_STRICT[f.type]] if f.optional else _STRICT[f.type]
        extra = {"max_length": f.max_length} if f.max_length else {}
        out[f.name] = (type_, Field(default=f.default, description=help_text(f), **extra))
    return out


RecipeFields = create_model(
    "RecipeFields", __doc__="The recipe settings ``planner estimate`` and ``suggest`` take (``TrainConfig``'s fields).",
    **_body_fields(RECIPE))

#: ``POST /v1/estimate``'s fields that make the configuration besides the recipe (``planner estimate``'s options)
_ConfigFields = create_model(
    "ConfigFields", __doc__="The options of one configuration (``planner estimate``'s).",
    **_body_fields(tuple(f for f in ESTIMATE if f.build and not f.recipe)))


#: ``POST /v1/plans``'s fields of the search besides the recipe (``planner suggest``'s options)
_SearchFields = create_model("SearchFields", __doc__="What a search is asked (``planner suggest``'s options).",
                             **_body_fields(tuple(SEARCH.values())))


class PlanBody(_SearchFields, RecipeFields, ModelChoice):
    """``POST /v1/plans``: the request of ``planner suggest``."""

    allow_offload: StrictBool = Field(default=True, description="Consider DeepSpeed CPU offload (false: --no-offload).")
    cpu_mem: Size = Field(default=None, description=f"Host RAM of the node for offload: {_SIZE_HELP} (default: the "
                          "catalog's standard machine with `gpus` of this GPU; where it knows none, offload plans need it).")
    fresh: StrictBool = Field(default=False, description="Plan again even when a verified plan of this request is stored.")
    verify: StrictBool = Field(default=False, description="Verify the top candidates with real runs as a Ray job (answers 202).")
    verify_top: StrictInt = Field(default=3, description="With verify: candidates to verify fitting.")
    steps: StrictInt = Field(default=3, description="With verify: optimizer steps per verification run.")


class EstimateBody(_ConfigFields, RecipeFields, ModelChoice):
    """``POST /v1/estimate``: one fully specified configuration, as ``planner estimate``."""


class CompareBody(RecipeFields):
    """``POST /v1/compare``: ``planner suggest --gpu any``, which GPU type and count to rent."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, examples=["meta-llama/Llama-3.1-8B"],
                       description="A catalog id (GET /v1/models), or the name to give the inline `config`.")
    config: Optional[dict[str, Any]] = ModelChoice.model_fields["config"]
    gpu_types: Optional[list[StrictStr]] = Field(
        default=None, max_length=64, description="GPU names to compare (GET /v1/gpus); default: every GPU of the catalog.")
    gpus_max: StrictInt = Field(default=8, description="The most GPUs of one node to compare (1, 2, 4, 8, 16 up to it).")
    target_batch: StrictInt = Field(description=SEARCH["target_batch"].help)
    seq_len: Optional[StrictInt] = Field(default=FIELDS["seq_len"].default, description=FIELDS["seq_len"].help)
    method: StrictStr = Field(default=SEARCH["method"].default, description=SEARCH["method"].help)
    precision: StrictStr = Field(default=SEARCH["precision"].default, description=SEARCH["precision"].help)
    prefer: StrictStr = Field(default=SEARCH["prefer"].default, description=SEARCH["prefer"].help)
    allow_offload: StrictBool = Field(default=True, description="Consider DeepSpeed CPU offload.")
    tokens: Optional[Union[StrictInt, StrictStr]] = Field(
        default=None, description="Tokens the job trains (1000000000, \"1e9\", \"2B\"); default: one billion.")
    epochs: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, description="Epochs over `dataset_tokens`, "
                                                            "instead of `tokens`.")
    dataset_tokens: Optional[Union[StrictInt, StrictStr]] = Field(default=None, description="Tokens of one epoch.")
    prices: Optional[dict[str, Union[StrictFloat, StrictInt]]] = Field(
        default=None, max_length=64, description="Your own dollars per GPU-hour by GPU name (replaces the shipped table).")


class FieldError(BaseModel):
    field: str = Field(description="The request field, dotted for nested ones (config.hidden_size).")
    reason: str


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: one line saying what is wrong and how to fix it."""

    error: str = Field(examples=["seq_len 9000 is longer than meta-llama/Llama-2-7b-hf allows (4096): use at most 4096"])
    field: Optional[str] = Field(default=None, description="The request field the error is about, when there is one.")
    errors: Optional[list[FieldError]] = Field(default=None, description="Every field that does not parse (422).")


__all__ = ["EstimateBody", "ErrorBody", "FieldError", "ModelChoice", "PlanBody", "RecipeFields", "Size"]
