"""The trainers' own schemas, read from their dataclasses: which keys a file may hold and what each
key is when the file leaves it out.

Every schema is the installed library's: ``transformers.TrainingArguments``, TRL's ``SFTConfig``,
``ModelConfig`` and ``ScriptArguments`` (the three dataclasses ``trl sft --config FILE`` parses a
YAML into: trl/scripts/sft.py ``TrlParser((ScriptArguments, SFTConfig, ModelConfig))``), peft's
``LoraConfig`` and accelerate's ``ClusterConfig``. They are imported when a file is checked
(transformers and accelerate import torch), never when the planner is imported.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import MissingDependencyError

#: the one key a plain TrainingArguments file may hold besides the dataclass's fields: the model,
#: as the HF example scripts' ``ModelArguments.model_name_or_path`` (transformers
#: examples/pytorch/language-modeling/run_clm.py) reads it from the same JSON file
MODEL_KEY = "model_name_or_path"


@dataclass(frozen=True, kw_only=True)
class Schema:
    """The keys of one trainer's arguments file and their defaults."""

    name: str
    """e.g. ``TRL 1.16.0 SFTConfig + ModelConfig + ScriptArguments``."""
    defaults: Mapping[str, Any]
    """Every key, with the value the dataclass gives it when the file leaves it out."""

    def value(self, data: Mapping[str, Any], key: str) -> Any:
        return data[key] if key in data else self.defaults.get(key)

    def unknown(self, data: Mapping[str, Any]) -> list[str]:
        return sorted(k for k in data if k not in self.defaults)


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
        else:
            out[field.name] = None
    return out


def _quiet_cpu_kernels() -> None:
    """transformers imports bitsandbytes, which on a CPU with AVX512-BF16 warns that it cannot load
    its optional Hub kernel ("Failed to load CPU gemm_4bit_forward from kernels-community":
    bitsandbytes 0.50 backends/cpu/ops.py, ``logger.warning`` under ``has_avx512bf16()``). Reading a
    file's keys runs no kernel, so ``planner check`` printed a warning that meant nothing."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _need(package: str, what: str):
    import importlib

    _quiet_cpu_kernels()
    try:
        return importlib.import_module(package)
    except ImportError:
        raise MissingDependencyError(
            f"reading {what} needs {package.split('.')[0]}, which is not installed: pip install 'oom-planner[workers]'"
        ) from None


@functools.cache
def hf_training_arguments() -> Schema:
    """transformers' TrainingArguments and the example scripts' model key."""
    transformers = _need("transformers", "a TrainingArguments file")
    defaults = _defaults(transformers.TrainingArguments)
    defaults[MODEL_KEY] = None
    return Schema(name=f"transformers {transformers.__version__} TrainingArguments", defaults=defaults)


@functools.cache
def trl_config() -> Schema | None:
    """The keys ``trl sft --config`` reads (SFTConfig, a TrainingArguments with SFT's own
    defaults, plus ModelConfig and ScriptArguments); None where TRL is not installed."""
    _quiet_cpu_kernels()
    try:
        import trl
        from trl import ModelConfig, ScriptArguments, SFTConfig
    except ImportError:
        return None
    defaults = {**_defaults(ScriptArguments), **_defaults(ModelConfig), **_defaults(SFTConfig)}
    return Schema(name=f"TRL {trl.__version__} SFTConfig + ModelConfig + ScriptArguments", defaults=defaults)


def training_arguments(data: Mapping[str, Any], *, trainer: str | None = None) -> Schema:
    """The schema a trainer's arguments file is read with: TRL's where ``trainer`` is "trl" or the
    file holds a key that only TRL has (SFTConfig's defaults differ from TrainingArguments':
    checkpointing and bf16 on, sequences of 1024); else transformers' TrainingArguments."""
    hf = hf_training_arguments()
    if trainer == "hf":
        return hf
    trl = trl_config()
    if trainer == "trl" and trl is None:
        raise MissingDependencyError("--trainer trl reads the file with TRL's SFTConfig: pip install trl")
    if trainer == "trl" or (trl is not None and any(k not in hf.defaults and k in trl.defaults for k in data)):
        return trl
    return hf


@functools.cache
def is_trl(schema_name: str) -> bool:
    return schema_name.startswith("TRL ")


@functools.cache
def lora_config() -> Schema:
    peft = _need("peft", "a PEFT adapter config")
    defaults = _defaults(peft.LoraConfig)
    # written by save_pretrained beside the fields (peft/config.py PeftConfigMixin.to_dict/save_pretrained)
    defaults.setdefault("peft_version", None)
    return Schema(name=f"peft {peft.__version__} LoraConfig", defaults=defaults)


@functools.cache
def bnb_config() -> Schema:
    transformers = _need("transformers", "a bitsandbytes config")
    import inspect

    params = inspect.signature(transformers.BitsAndBytesConfig.__init__).parameters
    defaults = {name: p.default if p.default is not inspect.Parameter.empty else None for name, p in params.items()
                if name not in ("self", "kwargs")}
    return Schema(name=f"transformers {transformers.__version__} BitsAndBytesConfig", defaults=defaults)


@functools.cache
def accelerate_config() -> Schema:
    accelerate = _need("accelerate", "an accelerate config")
    config_args = _need("accelerate.commands.config.config_args", "an accelerate config")
    return Schema(name=f"accelerate {accelerate.__version__} ClusterConfig", defaults=_defaults(config_args.ClusterConfig))


def load_all() -> None:
    """Import every trainer library a check may read with (each schema is cached once read); a
    library that is missing is left for the check that needs it to name."""
    for schema in (hf_training_arguments, trl_config, lora_config, bnb_config, accelerate_config):
        try:
            schema()
        except MissingDependencyError:
            pass


__all__ = ["MODEL_KEY", "load_all", "Schema", "accelerate_config", "bnb_config", "hf_training_arguments", "is_trl", "lora_config",
           "training_arguments", "trl_config"]
