"""A training setup's files -> the planner's options, each with the file and key it came from.

The rules each trainer applies are the trainer's, cited where they are used: TRL's defaults
(``bf16`` on unless ``fp16``: trl/trainer/base_config.py; checkpointing on: SFTConfig's field),
transformers' (``activation_checkpointing`` before its deprecated alias ``gradient_checkpointing``:
training_args.py ``__post_init__``), the HF Trainer's DeepSpeed checks (a number in the DeepSpeed
config must equal the Trainer's: transformers integrations/deepspeed.py ``fill_match``).

A key the schema does not have is an error that names it (as ``HfArgumentParser.parse_json_file``
refuses keys it does not use); a key whose value changes memory in a way the model has no term for
is an ``UnsupportedError`` that names it; a key that changes neither memory nor speed is read and
left alone; a setting planned approximately is said in ``notes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from planner.check import files as kinds
from planner.check.files import ConfigFile
from planner.check.schemas import MODEL_KEY, Schema
from planner.errors import InvalidConfigError, UnsupportedError
from planner.request import ADAPTER_RECIPE, TRAINING_ARGS


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where one option's value came from: a file's key, or the trainer's default for it."""

    file: str
    key: str
    value: Any
    given: bool
    """False: the key is not in the file and the schema's default holds."""


@dataclass(kw_only=True)
class Reading:
    """What the files say, as ``planner.estimation.build_config`` options, with their origins."""

    files: list[ConfigFile] = field(default_factory=list)
    schema: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)
    model: str | None = None
    seq_len: int | None = None
    gpus: int | None = None
    notes: list[str] = field(default_factory=list)
    trainer: str | None = None
    """The trainer whose one YAML file holds the run (``planner.check.trainers.MODULES``), else None."""
    buffers: dict[str, Any] | None = None
    """The memory-relevant keys a user's own DeepSpeed JSON sets (``deepspeed``): its bucket sizes
    and whether DeepSpeed builds a fused Adam; DeepSpeed's defaults hold for the ones it leaves
    out (``planner.sharding.Sharding.buffers``). None without a DeepSpeed JSON."""
    device_rules: list[Callable[["Reading", Any], None]] = field(default_factory=list)
    """Settings the trainer decides by the GPU (axolotl's ``bf16: auto``), applied once it is known."""
    model_rules: list[Callable[["Reading", Any, int], None]] = field(default_factory=list)
    """Settings the trainer decides by the model and the sequence length (LLaMA-Factory's RoPE scaling
    factor), applied with the resolved ``ModelSpec`` and the planned length."""
    resolve: Callable[[str, ConfigFile, str], ConfigFile] | None = None
    """How a file named by another (TrainingArguments' ``deepspeed``, ``fsdp_config``: (name, file, key)) is found: None reads the disk
    (``_on_disk``); the service resolves among the files sent, never on its own disk."""

    def by_kind(self, kind: str) -> ConfigFile | None:
        return next((f for f in self.files if f.kind == kind), None)

    def set(self, option: str, value: Any, *, file: ConfigFile | str, key: str, raw: Any = None, given: bool = True) -> None:
        self.options[option] = value
        path = file.path if isinstance(file, ConfigFile) else file
        self.origins[option] = Origin(file=path, key=key, value=value if raw is None else raw, given=given)


#: transformers' ``optim`` names -> the planner's optimizer (``planner.optim``: each descriptor's
#: ``hf_optim``), plus the names transformers gives the same optimizer
def _optimizers() -> dict[str, str]:
    from planner.optim import OPTIMIZERS

    names = {spec.hf_optim: str(name) for name, spec in OPTIMIZERS.items()}
    # transformers' OptimizerNames: ADAMW_8BIT "adamw_8bit" builds bnb.optim.AdamW8bit as adamw_bnb_8bit
    # does (trainer_optimizer.py)
    names.setdefault("adamw_8bit", names.get("adamw_bnb_8bit", "adamw_8bit"))
    return names


#: transformers' attn_implementation values the memory model has (``planner.config.Attention``)
ATTENTION = {None: "sdpa", "sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash"}
#: TrainingArguments' dtype names -> torch's
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16", "float32": "fp32",
           "fp32": "fp32", "float": "fp32", None: "fp32"}
#: model_init_kwargs keys (TRL: passed to from_pretrained) that the plan reads or that do not change memory,
#: and the model-config settings the Trainer overwrites from the training arguments (planner.request)
_INIT_KWARGS = {"dtype", "torch_dtype", "attn_implementation", "device_map", "trust_remote_code", "revision",
                *(f.training_args for f in TRAINING_ARGS if f.model_config)}


def _empty(value: Any) -> bool:
    return value in (None, "", False, [], {}, ())


def training_args(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """The options of a TrainingArguments / TRL config file."""
    from planner.check.schemas import is_trl, trl_config

    data = file.data
    unknown = schema.unknown(data)
    if unknown:
        hint = "" if is_trl(schema.name) or trl_config() is not None else \
            " (a TRL config? pip install trl, and its keys are read too)"
        raise InvalidConfigError(f"{file.path}: {', '.join(unknown)} {'is not a key' if len(unknown) == 1 else 'are not keys'} "
                                 f"of {schema.name}{hint}: fix the spelling or remove {'it' if len(unknown) == 1 else 'them'}")
    reading.schema = schema.name
    value = lambda key: schema.value(data, key)  # noqa: E731
    given = lambda key: key in data  # noqa: E731
    _refuse_unmodelled(file, value)
    if value(MODEL_KEY):
        reading.model = str(value(MODEL_KEY))
        reading.origins["model"] = Origin(file=file.path, key=MODEL_KEY, value=reading.model, given=True)
    reading.set("micro_batch", value("per_device_train_batch_size"), file=file, key="per_device_train_batch_size",
                given=given("per_device_train_batch_size"))
    reading.set("grad_accum", value("gradient_accumulation_steps"), file=file, key="gradient_accumulation_steps",
                given=given("gradient_accumulation_steps"))
    # transformers 5: activation_checkpointing, else its deprecated alias (training_args.py __post_init__)
    ckpt_key = "activation_checkpointing" if value("activation_checkpointing") is not None else "gradient_checkpointing"
    if not given(ckpt_key) and not given("gradient_checkpointing") and "activation_checkpointing" in schema.defaults:
        ckpt_key_written = "activation_checkpointing"  # a change writes the current name, not the deprecated alias
    else:
        ckpt_key_written = ckpt_key
    reading.set("grad_ckpt", bool(value(ckpt_key)), file=file, key=ckpt_key_written, raw=bool(value(ckpt_key)),
                given=given(ckpt_key))
    read_optimizer(reading, file, "optim", value, given)
    # the recipe settings TrainingArguments holds, by their keys (planner.request), in the order
    # emit writes them: the values, then the switches
    for f in sorted(TRAINING_ARGS, key=lambda f: f.switch):
        if f.evaluation:  # the eval pass's settings: read where eval_strategy evaluates (_evaluation)
            continue
        key = f.training_args
        if not f.switch:
            reading.set(f.name, bool(value(key)), file=file, key=key, given=given(key))
        elif value(key):  # a switch read only when on (Liger's: its other kernels are refused above)
            reading.set(f.name, True, file=file, key=key)
    if "max_length" in schema.defaults:  # TRL: sequences are truncated (and packed) to max_length
        if value("max_length") is None:
            reading.notes.append("max_length is null (no truncation): the longest sequence is --seq-len's")
        else:
            reading.seq_len = _count(file, "max_length", value("max_length"))
            reading.origins["seq_len"] = Origin(file=file.path, key="max_length", value=reading.seq_len,
                                                given=given("max_length"))
        packed = bool(value("packing")) or bool(value("padding_free"))
        key = "packing" if value("packing") or not value("padding_free") else "padding_free"
        reading.set("packing", packed, file=file, key=key, given=given(key))
    _precision_and_method(reading, file, schema)
    _attention(reading, file, schema)
    sharding_arguments(reading, file, value)
    _evaluation(reading, file, value, given)


def sharding_arguments(reading: Reading, file: ConfigFile, value: Callable[[str], Any]) -> None:
    """TrainingArguments' ``deepspeed`` or ``fsdp``/``fsdp_config`` (the HF arguments file's, and
    LLaMA-Factory's YAML, which holds the same TrainingArguments keys). ``fsdp_config`` without
    ``fsdp`` runs nothing (training_args.py ``_process_fsdp_args`` returns first), which is said."""
    if value("deepspeed") and not _empty(value("fsdp")):
        raise InvalidConfigError(f"{file.path}: fsdp and deepspeed are both set: keep one (accelerate runs one of them)")
    if value("deepspeed"):
        _deepspeed_reference(reading, file, value("deepspeed"))
    elif not _empty(value("fsdp")):
        _fsdp_arguments(reading, file, value("fsdp"), value("fsdp_config"))
    elif not _empty(value("fsdp_config")):
        reading.notes.append("fsdp_config without fsdp: transformers runs no FSDP (set fsdp: true to shard)")


def _evaluation(reading: Reading, file: ConfigFile, value, given) -> None:
    """A file whose ``eval_strategy`` evaluates runs the Trainer's evaluation_loop at its eval
    settings (``RequestField.evaluation`` with a ``training_args`` key: per_device_eval_batch_size,
    TrainingArguments' default 8), so the plan holds the eval pass (``planner.memory.evaluation``)."""
    strategy = str(value("eval_strategy"))
    if strategy in ("no", "IntervalStrategy.NO", "None"):
        return
    for f in TRAINING_ARGS:
        if f.evaluation and f.training_args:
            reading.set(f.name, _count(file, f.training_args, value(f.training_args)), file=file, key=f.training_args,
                        given=given(f.training_args))
    reading.notes.append(f"eval_strategy {strategy}: the plan holds the eval pass at per_device_eval_batch_size "
                         f"{value('per_device_eval_batch_size')}, each batch's logits freed with it (Trainer.evaluate "
                         "without compute_metrics); compute_metrics' gathered logits and generation are not read")


def _attention(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """TRL's ``attn_implementation`` (ModelConfig) or ``model_init_kwargs``'s; transformers' default
    (None: sdpa where torch has it, modeling_utils.py ``_check_and_adjust_attn_implementation``)."""
    init = schema.value(file.data, "model_init_kwargs") or {}
    key = "model_init_kwargs.attn_implementation" if "attn_implementation" in init else "attn_implementation"
    value = init.get("attn_implementation") if key != "attn_implementation" else schema.value(file.data, key)
    if key not in schema.defaults and key == "attn_implementation":
        return
    if not (value is None or isinstance(value, str)) or value not in ATTENTION:
        raise UnsupportedError(f"{file.path}: {key} {value!r} is not modelled: use sdpa, eager or flash_attention_2")
    reading.set("attention", ATTENTION[value], file=file, key=key, raw=value, given=key in file.data or key != "attn_implementation")


def read_optimizer(reading: "Reading", file: ConfigFile, key: str, value, given) -> None:
    """The HF ``optim`` name under ``key`` (TrainingArguments' optim, LLaMA-Factory's optim, axolotl's
    optimizer: the same names), refused with the modelled ones when it is not one of them."""
    optim = str(value(key))
    table = _optimizers()
    if optim not in table:
        raise UnsupportedError(f"{file.path}: {key} {optim!r} is not modelled: use one of {', '.join(sorted(table))}")
    reading.set("optimizer", table[optim], file=file, key=key, raw=optim, given=given(key))


def _refuse_unmodelled(file: ConfigFile, value) -> None:
    """The keys whose value the memory model has no term for: refused with the key named (the
    ``fsdp`` keys are read: ``sharding_arguments``)."""
    problems = []
    if value("parallelism_config") is not None:
        problems.append("parallelism_config (tensor/context parallelism is not modelled)")
    if value("auto_find_batch_size"):
        problems.append("auto_find_batch_size (the Trainer halves the batch after an OOM, so the batch is not the "
                        "file's: set it false to check per_device_train_batch_size)")
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kwargs = value(key) or {}
        if isinstance(kwargs, Mapping) and (kwargs.get("every_n_layers", 1) != 1 or kwargs.get("offload")):
            problems.append(f"{key} every_n_layers/offload (checkpointing is modelled on every layer, on the device)")
    if value("use_liger_kernel"):
        kernels = value("liger_kernel_config") or {}
        others = [k for k in ("cross_entropy", "rms_norm", "rope", "swiglu")
                  if not isinstance(kernels, Mapping) or kernels.get(k, True)]
        if others:
            problems.append(f"use_liger_kernel with {', '.join(others) or 'its kernels'} on (only the fused linear "
                            "cross-entropy is modelled: set liger_kernel_config to turn the others off)")
    for key, why in (("activation_offloading", "activations offloaded to the CPU"), ("load_in_8bit", "8-bit base weights"),
                     ("use_dora", "DoRA's magnitude vectors and weight norms"),
                     ("lora_modules_to_save", "fully trained module copies"),
                     ("lora_target_parameters", "LoRA on parameters")):
        if not _empty(value(key)):
            problems.append(f"{key} ({why} are not modelled)")
    init = value("model_init_kwargs") or {}
    extra = sorted(set(init) - _INIT_KWARGS) if isinstance(init, Mapping) else ["(not a mapping)"]
    if extra:
        problems.append(f"model_init_kwargs {', '.join(extra)} (not read by the planner)")
    if problems:
        raise UnsupportedError(f"{file.path}: {'; '.join(problems)}")


def _dtype(reading: Reading, file: ConfigFile, schema: Schema) -> tuple[str, str | None]:
    """The dtype the model is loaded in (TRL's ModelConfig ``dtype``, or ``model_init_kwargs``),
    with the key it came from."""
    data = file.data
    init = schema.value(data, "model_init_kwargs") or {}
    for key in ("dtype", "torch_dtype"):
        if key in init:
            return _dtype_name(file, f"model_init_kwargs.{key}", init[key]), f"model_init_kwargs.{key}"
    if "dtype" in schema.defaults:
        return _dtype_name(file, "dtype", schema.value(data, "dtype")), "dtype"
    return "fp32", None


def _dtype_name(file: ConfigFile, key: str, value: Any) -> str:
    if not (value is None or isinstance(value, str)) or value not in _DTYPES:
        raise UnsupportedError(f"{file.path}: {key} {value!r} is not read by the planner: write bfloat16, float16 or float32")
    return _DTYPES[value]


def _precision_and_method(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """Method (full, LoRA from TRL's ``use_peft`` or a PEFT adapter config beside, QLoRA from
    ``load_in_4bit``) and precision (TrainingArguments' autocast flags over the loaded dtype)."""
    from planner.check.schemas import is_trl

    data = file.data
    value = lambda key: schema.value(data, key)  # noqa: E731
    fp16 = bool(value("fp16"))
    bf16 = value("bf16")
    if bf16 is None:  # TRL: bf16 defaults to True unless fp16 (trl/trainer/base_config.py)
        bf16 = not fp16
    if bf16 and fp16:
        raise InvalidConfigError(f"{file.path}: bf16 and fp16 are both true: keep one (the Trainer refuses both)")
    flag = "bf16" if bf16 else "fp16" if fp16 else None
    dtype, dtype_key = _dtype(reading, file, schema)
    quantized = bool(value("load_in_4bit"))
    if value("use_peft") or quantized:
        reading.set("method", "qlora" if quantized else "lora", file=file, key="load_in_4bit" if quantized else "use_peft")
        targets = value("lora_target_modules")
        reading.set("lora_r", value("lora_r"), file=file, key="lora_r", given="lora_r" in data)
        reading.set("lora_targets", _targets(targets), file=file, key="lora_target_modules", raw=targets,
                    given="lora_target_modules" in data)
        _adapter_recipe(reading, file, value, {f.name: f.trl for f in ADAPTER_RECIPE})
    if quantized and is_trl(schema.name):
        # TRL's SFTTrainer loads the 4-bit model in ModelConfig's dtype and wraps it with get_peft_model alone: no
        # prepare_model_for_kbit_training, so the non-4-bit parameters stay in the load dtype (trl 1.16
        # trainer/sft_trainer.py l.806-869; 0.13 still ran it, skipping it for sharded QLoRA, l.182-231): fp32, the
        # default dtype, is what peft's upcast gives; a 16-bit dtype keeps them 16-bit
        reading.set("kbit_upcast", dtype == "fp32", file=file, key=dtype_key or "dtype", raw=dtype,
                    given=bool(dtype_key) and (dtype_key.startswith("model_init_kwargs") or dtype_key in data))
    if quantized and not value("use_bnb_nested_quant"):
        reading.notes.append("use_bnb_nested_quant false: the plan counts NF4 with double quantization, "
                             "0.37 bit a weight less than without (QLoRA paper, section 2)")
    if dtype != "fp32" and flag is not None and flag != dtype:
        raise InvalidConfigError(f"{file.path}: the model is loaded in {dtype} ({dtype_key}) but {flag} is true: "
                                 f"make them agree")
    quantized_method = quantized
    if quantized_method:
        precision = f"{flag}-mixed" if flag else dtype
    else:
        precision = dtype if dtype != "fp32" else f"{flag}-mixed" if flag else "fp32"
    key = dtype_key if dtype != "fp32" and not (quantized_method and flag) else (flag or "bf16")
    reading.set("precision", precision, file=file, key=key, raw=value(key) if key in schema.defaults else None,
                given=key in data or bool(dtype_key and dtype_key.startswith("model_init_kwargs")))


def _targets(value: Any) -> Any:
    """TRL's/peft's target_modules: a list of names, "all-linear", or None (peft's default per
    architecture: q and v projections for Llama-like models, peft/utils/constants.py)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise InvalidConfigError(f"target modules must be a list of module names or \"all-linear\", got {value!r}")
    return tuple(str(v) for v in value)


def _adapter_recipe(reading: Reading, file: ConfigFile, value: Callable[[str], Any], keys: Mapping[str, str]) -> None:
    """The adapter's recipe settings (its dropout), each from its key in ``file`` (``keys``: TRL's
    or PEFT's, planner.request), as a number."""
    for name, key in keys.items():
        reading.set(name, _probability(file, key, value(key)), file=file, key=key, given=key in file.data)


def _probability(file: ConfigFile, key: str, value: Any) -> float:
    """A dropout as a number (TrainConfig checks its range with the fix)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfigError(f"{file.path}: {key} must be a number from 0 to below 1, got {value!r}")
    return float(value)


def _count(file: ConfigFile, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{file.path}: {key} must be a whole number, got {value!r}")
    return value


def _section(file: ConfigFile, key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidConfigError(f"{file.path}: {key} must be a mapping of settings, got {value!r}")
    return value


#: transformers 5's FSDP version when fsdp_config names none (training_args.py ``_process_fsdp_args``:
#: ``fsdp_config.get("version", 2)``); accelerate's own config keeps FSDP1 unless ``fsdp_version`` says 2
#: (utils/dataclasses.py FullyShardedDataParallelPlugin ``__post_init__``: ``os.environ.get("FSDP_VERSION", "1")``)
_FSDP_VERSION = {"transformers": 2, "accelerate": 1}
#: FSDP1's sharding strategies by accelerate's numbering (utils/constants.py FSDP_SHARDING_STRATEGY: "1" is FULL_SHARD)
_FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def _fsdp_arguments(reading: Reading, file: ConfigFile, fsdp: Any, settings: Any) -> None:
    """TrainingArguments' ``fsdp`` (True, or the legacy option string or list: "full_shard
    auto_wrap offload") and ``fsdp_config`` (a mapping, or a JSON file's path; keys with or without
    their ``fsdp_`` prefix), read as transformers 5 reads them (training_args.py
    ``_process_fsdp_args`` and ``_apply_legacy_fsdp_to_config``)."""
    home, prefix = file, "fsdp_config."  # where fsdp_config's keys are written
    if isinstance(settings, str):
        home, prefix = _named_file(reading, file, settings, "fsdp_config"), ""
        settings = home.data
    where, config = fsdp_settings(file, settings, prefix)
    version = _fsdp_version(file, "fsdp_config.version", config.get("version", _FSDP_VERSION["transformers"]))
    if _flag(file, where.get("xla", "xla"), config.get("xla", False)):
        raise UnsupportedError(f"{file.path}: fsdp_config.xla (PyTorch/XLA's FSDP on TPUs) is not modelled: the planner "
                               "plans CUDA and CPU devices")
    legacy_fsdp(file, fsdp, config, version)
    _fsdp(reading, home, version=version, strategy=config.get("reshard_after_forward", True if version == 2 else "FULL_SHARD"),
          offload=config.get("cpu_offload", False), checkpointing=config.get("activation_checkpointing"),
          keys=tuple(where.get(name, f"{prefix}{name}") for name in ("version", "reshard_after_forward", "cpu_offload",
                                                                   "activation_checkpointing")),
          given=lambda key: key in where.values())
    wrap_note(reading, config)


def fsdp_settings(file: ConfigFile, settings: Any, prefix: str = "fsdp_config.") -> tuple[dict[str, str], dict[str, Any]]:
    """(each setting's name -> its key as the file writes it, each name -> its value) of an
    ``fsdp_config`` mapping, its keys read with or without their ``fsdp_`` prefix (transformers
    strips it: training_args.py ``_process_fsdp_args``; axolotl too: utils/schemas/validation.py
    ``check_fsdp_config_kwargs_prefix``)."""
    section = _section(file, "fsdp_config", settings)
    where = {(k[5:] if k.startswith("fsdp_") else k): f"{prefix}{k}" for k in section}
    return where, {name: section[key.removeprefix(prefix)] for name, key in where.items()}


def legacy_fsdp(file: ConfigFile, fsdp: Any, config: dict[str, Any], version: int) -> None:
    """The legacy ``fsdp`` option string or list put into ``config`` as transformers 5 puts it
    (``_apply_legacy_fsdp_to_config``: a strategy is reshard_after_forward's legacy spelling,
    ``offload`` is cpu_offload, ``auto_wrap`` the default policy); ``config``'s own values win
    (transformers' setdefault). True (``fsdp: true``) says nothing more."""
    if not isinstance(fsdp, (str, list, tuple)):
        return
    for item in (fsdp.split() if isinstance(fsdp, str) else [str(i) for i in fsdp]):
        if item.upper() in _FSDP1_STRATEGIES:
            if item.upper() != "FULL_SHARD" and "reshard_after_forward" not in config:
                raise _not_full_shard(file, "fsdp", item)
            name, value = "reshard_after_forward", item if version == 1 else True
        elif item == "offload":
            name, value = "cpu_offload", True
        elif item == "auto_wrap":
            continue
        else:
            raise InvalidConfigError(f"{file.path}: fsdp option {item!r} is not one of transformers': full_shard, "
                                     "shard_grad_op, hybrid_shard, no_shard, offload, auto_wrap")
        config.setdefault(name, value)


def wrap_note(reading: Reading, config: Mapping[str, Any]) -> None:
    if config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        reading.notes.append(f"fsdp_config.auto_wrap_policy {config['auto_wrap_policy']}: planned as one FSDP unit per "
                             "decoder layer (TRANSFORMER_BASED_WRAP), the units the memory model gathers")


def _not_full_shard(file: ConfigFile, key: str, value: Any) -> UnsupportedError:
    return UnsupportedError(f"{file.path}: {key} {value!r} is not modelled: FSDP is planned fully sharded (full_shard: "
                            "FSDP2's reshard_after_forward true, FSDP1's FULL_SHARD); for gradients and optimizer "
                            "states sharded alone, use DeepSpeed ZeRO-2 (key deepspeed)")


def _fsdp_version(file: ConfigFile, key: str, value: Any) -> int:
    if str(value) not in ("1", "2"):
        raise InvalidConfigError(f"{file.path}: {key} must be 1 or 2, got {value!r}")
    return int(value)


#: transformers' and accelerate's ``str_to_bool`` spellings (a missing setting, None, reads as false)
_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0", "none")


def _flag(file: ConfigFile, key: str, value: Any) -> bool:
    """A true/false setting as transformers and accelerate read one (``str_to_bool`` of its text)."""
    text = str(value).lower()
    if text not in _TRUE and text not in _FALSE:
        raise InvalidConfigError(f"{file.path}: {key} must be true or false, got {value!r}")
    return text in _TRUE


def _fsdp(reading: Reading, file: ConfigFile, *, version: int, strategy: Any, offload: Any, checkpointing: Any,
          keys: tuple[str, str, str, str], given: Callable[[str], bool]) -> None:
    """The sharding an FSDP setup runs: FSDP1 or FSDP2 (``planner.sharding``), fully sharded (FSDP2's
    ``reshard_after_forward`` true, FSDP1's FULL_SHARD: the only strategy the memory model has), its
    CPU offload (parameters, gradients and the optimizer step on the host) and FSDP's own activation
    checkpointing of each unit (the non-reentrant checkpoint per decoder layer the model's own is)."""
    version_key, strategy_key, offload_key, ckpt_key = keys
    if version == 2:
        full = _flag(file, strategy_key, strategy)
    else:
        name = str(strategy).upper()
        name = _FSDP1_STRATEGIES[int(name) - 1] if name.isdigit() and 1 <= int(name) <= 5 else name
        full = name == "FULL_SHARD"
    if not full:
        raise _not_full_shard(file, strategy_key, strategy)
    reading.set("sharding", f"fsdp{version}", file=file, key=version_key, raw=version, given=given(version_key))
    reading.set("offload", "optimizer+params" if _flag(file, offload_key, offload) else "none", file=file,
                key=offload_key, raw=offload, given=given(offload_key))
    if checkpointing is not None and _flag(file, ckpt_key, checkpointing):
        reading.set("grad_ckpt", True, file=file, key=ckpt_key)
        reading.notes.append(f"{ckpt_key}: FSDP's checkpoint wrapper on each unit, planned as checkpointing every "
                             "decoder layer")


def _deepspeed_reference(reading: Reading, file: ConfigFile, ref: Any) -> None:
    """TrainingArguments' ``deepspeed``: a path (relative to the working directory, as the Trainer
    opens it; the file's folder is tried too) or the config itself as a mapping."""
    if isinstance(ref, Mapping):
        reading.files.append(ConfigFile(path=f"{file.path}#deepspeed", kind=kinds.DEEPSPEED, data=ref))
        return
    _named_file(reading, file, str(ref), "deepspeed")


def _named_file(reading: Reading, file: ConfigFile, ref: str, key: str) -> ConfigFile:
    """The file ``file``'s ``key`` names (``Reading.resolve``, else the disk), read once into ``reading``."""
    found = (reading.resolve or _on_disk)(ref, file, key)
    if all(not _same(f.path, found.path) for f in reading.files):
        reading.files.append(found)
    return found


def _on_disk(ref: str, file: ConfigFile, key: str) -> ConfigFile:
    path = Path(ref)
    found = next((p for p in (path, Path(file.path).parent / path) if p.is_file()), None)
    if found is None:
        raise InvalidConfigError(f"{file.path}: {key} names {ref}, which is not a file here or beside {file.path}: "
                                 f"give the {'DeepSpeed JSON' if key == 'deepspeed' else 'FSDP config'}'s path")
    return kinds.read(found)


def _same(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:  # pragma: no cover - a name that is no path
        return a == b


def deepspeed(reading: Reading, file: ConfigFile) -> None:
    """ZeRO stage and offload of a DeepSpeed JSON, and its numbers checked against the Trainer's."""
    zero = _section(file, "zero_optimization", file.data.get("zero_optimization"))
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise InvalidConfigError(f"{file.path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    reading.set("zero", stage, file=file, key="zero_optimization.stage", given="stage" in zero)
    devices = {part: str(_section(file, f"zero_optimization.{part}", zero.get(part)).get("device", "none"))
               for part in ("offload_optimizer", "offload_param")}
    if "nvme" in devices.values():
        raise UnsupportedError(f"{file.path}: offload to nvme is not modelled: offload to cpu, or none")
    if devices["offload_param"] == "cpu" and devices["offload_optimizer"] != "cpu":
        raise UnsupportedError(f"{file.path}: offload_param without offload_optimizer is not modelled: offload both, or "
                               "the optimizer alone")
    offload = "optimizer+params" if devices["offload_param"] == "cpu" else "optimizer" if devices["offload_optimizer"] == "cpu" \
        else "none"
    reading.set("offload", offload, file=file, key="zero_optimization.offload_optimizer.device",
                raw=devices["offload_optimizer"], given="offload_optimizer" in zero)
    reading.buffers = _ds_buffers(file, zero)
    precision, origin = reading.options.get("precision"), reading.origins.get("precision")
    for name in ("bf16", "fp16"):
        enabled = _section(file, name, file.data.get(name)).get("enabled", "auto")
        if isinstance(enabled, bool) and precision is not None and enabled != (precision == f"{name}-mixed"):
            raise InvalidConfigError(f"{file.path}: {name}.enabled {str(enabled).lower()} differs from {origin.key} in "
                                     f"{origin.file} ({precision}): make them agree, or write \"auto\" (the HF Trainer "
                                     "refuses a mismatch)")
    for key, option in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        number = file.data.get(key, "auto")
        if number == "auto":
            continue
        origin = reading.origins.get(option)
        if origin is not None and origin.given and reading.options[option] != number:
            raise InvalidConfigError(f"{file.path}: {key} {number} differs from {origin.key} {reading.options[option]} in "
                                     f"{origin.file}: make them equal, or write \"auto\" (the HF Trainer refuses a mismatch)")
        if origin is None or not origin.given:
            reading.set(option, number, file=file, key=key)


#: the ``zero_optimization`` keys that size DeepSpeed's buffers (planner/sharding/zero.py DS_DEFAULTS)
_BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")


def _ds_buffers(file: ConfigFile, zero: dict[str, Any]) -> dict[str, Any]:
    """The bucket keys the file sets (a number of elements, or "auto" for the HF Trainer to fill),
    and ``torch_adam`` (0/1) where its ``optimizer`` section has DeepSpeed build Adam or AdamW
    (deepspeed 0.19.8 runtime/engine.py l.2378: torch_adam defaults to False, FusedAdam on a GPU);
    the keys it leaves out keep DeepSpeed's defaults (``planner.sharding.zero.zero_buckets``)."""
    out: dict[str, Any] = {}
    for key in _BUCKET_KEYS:
        if key not in zero:
            continue
        value = zero[key]
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise InvalidConfigError(f"{file.path}: zero_optimization.{key} must be a number of elements or \"auto\", "
                                     f"got {value!r}")
        out[key] = value if value == "auto" else int(value)
    optimizer = _section(file, "optimizer", file.data.get("optimizer"))
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        params = _section(file, "optimizer.params", optimizer.get("params"))
        out["torch_adam"] = int(bool(params.get("torch_adam", False)))
    return out


def adapter(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """A PEFT adapter config (``adapter_config.json``, ``LoraConfig`` fields): LoRA on the model."""
    data = file.data
    unknown = schema.unknown(data)
    if unknown:
        raise InvalidConfigError(f"{file.path}: {', '.join(unknown)} not keys of {schema.name}: fix or remove them")
    if str(data.get("peft_type", "LORA")).upper() != "LORA":
        raise UnsupportedError(f"{file.path}: peft_type {data.get('peft_type')} is not modelled: LoRA only")
    problems = [key for key in ("use_dora", "modules_to_save", "layers_to_transform", "target_parameters",
                                "trainable_token_indices", "layer_replication", "rank_pattern")
                if not _empty(data.get(key))]
    if problems:
        raise UnsupportedError(f"{file.path}: {', '.join(problems)} not modelled (they change what is trained): "
                               "remove them to check the plain LoRA")
    method = "qlora" if reading.options.get("method") == "qlora" else "lora"
    reading.set("method", method, file=file, key="peft_type", raw=data.get("peft_type", "LORA"))
    value = lambda key: schema.value(data, key)  # noqa: E731
    reading.set("lora_r", value("r"), file=file, key="r", given="r" in data)
    reading.set("lora_targets", _targets(value("target_modules")), file=file, key="target_modules",
                raw=value("target_modules"), given="target_modules" in data)
    _adapter_recipe(reading, file, value, {f.name: f.peft for f in ADAPTER_RECIPE})


def bnb(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """A ``BitsAndBytesConfig`` file: 4-bit NF4 makes the plan QLoRA."""
    unknown = schema.unknown(file.data)
    if unknown:
        raise InvalidConfigError(f"{file.path}: {', '.join(unknown)} not keys of {schema.name}: fix or remove them")
    if file.data.get("load_in_8bit") or not file.data.get("load_in_4bit"):
        raise UnsupportedError(f"{file.path}: only load_in_4bit (QLoRA) is modelled")
    reading.set("method", "qlora", file=file, key="load_in_4bit")


def accelerate(reading: Reading, file: ConfigFile, schema: Schema) -> None:
    """An accelerate config: processes (GPUs), mixed precision, DeepSpeed's stage and offload."""
    data = file.data
    unknown = schema.unknown(data)
    if unknown:
        raise InvalidConfigError(f"{file.path}: {', '.join(unknown)} not keys of {schema.name}: fix or remove them")
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind not in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP", "MULTI_CPU"):
        raise UnsupportedError(f"{file.path}: distributed_type {kind} is not modelled: NO, MULTI_GPU, DEEPSPEED or FSDP")
    if _count(file, "num_machines", data.get("num_machines", 1) or 1) > 1:
        raise UnsupportedError(f"{file.path}: num_machines {data['num_machines']}: the planner plans one node")
    reading.gpus = _count(file, "num_processes", data.get("num_processes", 1) or 1)
    reading.origins["gpus"] = Origin(file=file.path, key="num_processes", value=reading.gpus, given="num_processes" in data)
    mixed = str(data.get("mixed_precision", "no"))
    if mixed not in ("no", "fp16", "bf16", "fp8"):
        raise UnsupportedError(f"{file.path}: mixed_precision {mixed} is not modelled: no, fp16, bf16 or fp8")
    backend = str((data.get("fp8_config") or {}).get("backend", "AO")).upper()
    if mixed == "fp8" and backend != "AO":
        # accelerate picks torchao first when no backend is named (accelerator.py: "Prioritize AO -> TE -> MSAMP")
        raise UnsupportedError(f"{file.path}: fp8_config backend {backend} is not modelled: AO (torchao's float8 linears)")
    if "precision" not in reading.options:
        precision = "fp32" if mixed == "no" else "fp8" if mixed == "fp8" else f"{mixed}-mixed"
        reading.set("precision", precision, file=file, key="mixed_precision", raw=mixed)
    ds = _section(file, "deepspeed_config", data.get("deepspeed_config"))
    if kind == "DEEPSPEED" and ds.get("deepspeed_config_file"):
        _deepspeed_reference(reading, file, ds["deepspeed_config_file"])
    elif kind == "DEEPSPEED":
        stage = ds.get("zero_stage", 0)
        reading.set("zero", stage, file=file, key="deepspeed_config.zero_stage")
        opt, param = str(ds.get("offload_optimizer_device", "none")), str(ds.get("offload_param_device", "none"))
        if "nvme" in (opt, param):
            raise UnsupportedError(f"{file.path}: offload to nvme is not modelled: offload to cpu, or none")
        offload = "optimizer+params" if param == "cpu" else "optimizer" if opt == "cpu" else "none"
        reading.set("offload", offload, file=file, key="deepspeed_config.offload_optimizer_device", raw=opt)
        if "gradient_accumulation_steps" in ds and "grad_accum" not in reading.options:
            reading.set("grad_accum", ds["gradient_accumulation_steps"], file=file, key="deepspeed_config.gradient_accumulation_steps")
    if kind == "FSDP":
        _accelerate_fsdp(reading, file, _section(file, "fsdp_config", data.get("fsdp_config")))


def _accelerate_fsdp(reading: Reading, file: ConfigFile, fsdp: Mapping[str, Any]) -> None:
    """accelerate's ``fsdp_config`` section (the ``FSDP_*`` variables ``accelerate launch`` sets:
    utils/launch.py ``prepare_multi_gpu_env``). FSDP1's strategy is ``fsdp_sharding_strategy``,
    else ``fsdp_reshard_after_forward`` (FSDP2's boolean, FSDP1's strategy name)."""
    if "sharding" in reading.options:  # the arguments file's own fsdp_config, read first, is what the Trainer runs
        return
    version = _fsdp_version(file, "fsdp_config.fsdp_version", fsdp.get("fsdp_version", _FSDP_VERSION["accelerate"]))
    strategy_key = "fsdp_sharding_strategy" if version == 1 and "fsdp_sharding_strategy" in fsdp else "fsdp_reshard_after_forward"
    _fsdp(reading, file, version=version, strategy=fsdp.get(strategy_key, True if version == 2 else "FULL_SHARD"),
          offload=fsdp.get("fsdp_offload_params", False), checkpointing=fsdp.get("fsdp_activation_checkpointing"),
          keys=tuple(f"fsdp_config.{k}" for k in ("fsdp_version", strategy_key, "fsdp_offload_params",
                                                   "fsdp_activation_checkpointing")),
          given=lambda key: key.split(".", 1)[1] in fsdp)


__all__ = ["ATTENTION", "Origin", "Reading", "accelerate", "adapter", "bnb", "deepspeed", "read_optimizer", "training_args"]
