"""Reading the files of an existing training setup: JSON or YAML, each told apart by the schema its
keys belong to (a DeepSpeed config, a PEFT adapter config, a bitsandbytes config, an accelerate
config, the ``fsdp_config`` file TrainingArguments names, else the trainer's arguments).

Nothing here knows a trainer's keys by heart: the schemas are read from the trainers' own
dataclasses (``planner.check.schemas``); this module only loads text and picks the reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from planner.errors import InvalidConfigError, MissingDependencyError

#: the largest file ``planner check`` reads: a training config is a few KiB; a bigger file is not one
MAX_FILE_BYTES = 1 << 20

#: the kinds of file, as ``planner check`` names them in its answer
TRAINING_ARGS, ACCELERATE, DEEPSPEED, ADAPTER, BNB, FSDP = "training arguments", "accelerate config", "DeepSpeed config", \
    "PEFT adapter config", "bitsandbytes config", "FSDP config"

#: the keys of TrainingArguments' ``fsdp_config`` file (transformers 5 training_args.py: the documented
#: fsdp_config keys and those ``_process_fsdp_args`` reads), each also written with its ``fsdp_`` prefix
FSDP_KEYS = frozenset({"version", "auto_wrap_policy", "min_num_params", "transformer_layer_cls_to_wrap", "reshard_after_forward",
                       "cpu_offload", "backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params",
                       "sync_module_states", "cpu_ram_efficient_loading", "state_dict_type", "activation_checkpointing",
                       "xla", "xla_fsdp_settings", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"})


@dataclass(frozen=True, kw_only=True)
class ConfigFile:
    """One file as read: its path (as the user named it), its kind and its keys."""

    path: str
    kind: str
    data: Mapping[str, Any]


def load_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a .json, .yaml or .yml file, or one line saying why not."""
    file = Path(path)
    if not file.is_file():
        raise InvalidConfigError(f"{path}: no such file: give the path of a training config (.json, .yaml or .yml)")
    if file.stat().st_size > MAX_FILE_BYTES:
        raise InvalidConfigError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB: a training config is a few KiB; "
                                 "give the config file, not a data or model file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidConfigError(f"{path} is not UTF-8 text: give a JSON or YAML training config") from None
    return parse_mapping(str(path), text)


def parse_mapping(name: str, text: str) -> dict[str, Any]:
    """The top-level mapping of a file's text; ``name``'s suffix says JSON or YAML."""
    path = name
    suffix = Path(name).suffix.lower()
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise InvalidConfigError(f"{name} is larger than {MAX_FILE_BYTES >> 20} MiB: a training config is a few KiB")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): "
                                     "fix the file") from None
        except RecursionError:  # nesting deeper than the interpreter's recursion limit
            raise InvalidConfigError(f"{path} nests its values too deeply to be a training config: fix the file") from None
    elif suffix in (".yaml", ".yml"):
        data = _yaml(text, path)
    else:
        raise InvalidConfigError(f"{path}: planner check reads .json, .yaml and .yml files, not {suffix or 'this file'}")
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise InvalidConfigError(f"{path} does not hold a mapping of settings (key: value) at its top level: "
                                 "give a training config file")
    return data


def _yaml(text: str, path: str | Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with transformers and accelerate
        raise MissingDependencyError("reading YAML needs PyYAML: pip install pyyaml (or 'oom-planner[workers]')") from None
    try:
        return yaml.safe_load(text)
    except RecursionError:  # nesting deeper than the interpreter's recursion limit
        raise InvalidConfigError(f"{path} nests its values too deeply to be a training config: fix the file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise InvalidConfigError(f"{path} is not valid YAML{where}: {problem}; fix the file") from None


def kind_of(data: Mapping[str, Any]) -> str:
    """Which kind of file these keys are, by the schema each kind's keys come from: DeepSpeed's
    config has ``zero_optimization`` or ``train_micro_batch_size_per_gpu`` (deepspeed.ai/docs/config-json),
    peft's saved ``adapter_config.json`` has ``peft_type`` (peft/config.py ``PeftConfigMixin``),
    ``BitsAndBytesConfig`` has ``load_in_4bit`` without a trainer's keys, accelerate's config has
    ``distributed_type`` (accelerate/commands/config/config_args.py ``BaseConfig``). An axolotl,
    LLaMA-Factory or torchtune YAML is told apart from the HF arguments afterwards, by its trainer's
    keys (``planner.check.trainers.kind_of``)."""
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:
        return DEEPSPEED
    if "peft_type" in data:
        return ADAPTER
    if "distributed_type" in data or "compute_environment" in data:
        return ACCELERATE
    names = {k.removeprefix("fsdp_") for k in data}
    if names and names <= FSDP_KEYS and names != {"activation_checkpointing"}:  # (a TrainingArguments key too)
        return FSDP
    if "load_in_4bit" in data and "per_device_train_batch_size" not in data and "model_name_or_path" not in data \
            and "base_model" not in data:
        return BNB
    return TRAINING_ARGS


def read(path: str | Path) -> ConfigFile:
    data = load_mapping(path)
    return ConfigFile(path=str(path), kind=kind_of(data), data=data)


def parse(name: str, text: str) -> ConfigFile:
    """A file sent as text (``POST /v1/check``): nothing is read from disk."""
    data = parse_mapping(name, text)
    return ConfigFile(path=name, kind=kind_of(data), data=data)


__all__ = ["ACCELERATE", "ADAPTER", "BNB", "ConfigFile", "DEEPSPEED", "FSDP", "FSDP_KEYS", "MAX_FILE_BYTES", "TRAINING_ARGS", "kind_of",
           "load_mapping", "parse", "parse_mapping", "read"]
