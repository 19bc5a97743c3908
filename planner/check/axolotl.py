"""An axolotl YAML (``axolotl train config.yml``), read with axolotl's ``AxolotlInputConfig`` as
shipped (planner/data/trainers/axolotl.json), and a configuration written as its keys.

axolotl's rules, cited where they are used: the dtype the model is loaded in
(axolotl/utils/config/__init__.py ``resolve_dtype``: ``bf16`` or ``bfloat16`` loads it in
bfloat16, ``fp16``/``float16`` in float16, else float32; ``bf16: auto`` is bf16 where the GPU has
it), so full fine-tuning in bf16 is pure bf16 (no fp32 master weights); ``adapter: qlora`` needs
``load_in_4bit`` (utils/schemas/validation.py); ``lora_target_linear`` adapts every linear; FSDP
runs where ``fsdp_config`` or the legacy ``fsdp`` list is, FSDP1 unless a version says 2 (``_sharding``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from planner.check.files import ConfigFile
from planner.check.trainers import read_spelled, read_switches, refuse_unknown, schema_of, shipped
from planner.errors import InvalidConfigError, UnsupportedError
from planner.request import trainer_values, unexpressible

if TYPE_CHECKING:  # pragma: no cover
    from planner.check.reading import Reading
    from planner.check.schemas import Schema
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec

KIND = "axolotl config"
MODULE = "axolotl"
#: how axolotl runs a config (docs: docs/cli.qmd)
LAUNCH = "axolotl train {file}"
#: the key of the model's own checkpointing (``trainers.key_changes``: an FSDP file's may be FSDP's instead)
CHECKPOINTING = "gradient_checkpointing"
#: keys whose value changes memory in a way the planner has no term for, with what they do
UNMODELLED = {"load_in_8bit": "8-bit base weights", "peft_use_dora": "DoRA's magnitude vectors",
              "lora_modules_to_save": "fully trained module copies", "activation_offloading": "activations offloaded",
              "xformers_attention": "xformers attention", "unfrozen_parameters": "partly frozen full fine-tuning",
              "plugins": "plugins (their own keys and kernels)", "rl": "preference training (rl)",
              "tensor_parallel_size": "tensor parallelism", "context_parallel_size": "context parallelism",
              "peft_layers_to_transform": "LoRA on some layers", "relora": "ReLoRA", "lora_mlp_kernel": "axolotl's LoRA kernels",
              "lora_qkv_kernel": "axolotl's LoRA kernels", "lora_o_kernel": "axolotl's LoRA kernels"}
_ATTENTION_KEYS = {"flash_attention": "flash", "sdp_attention": "sdpa", "eager_attention": "eager"}
#: the fields of axolotl's ``FSDPConfig`` (0.19.0 utils/schemas/fsdp.py l.15-82; "version" is fsdp_version's
#: alias; a later revision drops sync_module_states and use_orig_params, which the plan does not read), by
#: their names without the ``fsdp_`` prefix (validation.py l.1192-1212 strips it): pydantic drops any other key
FSDP_FIELDS = ("version", "activation_checkpointing", "offload_params", "sync_module_states", "cpu_ram_efficient_loading",
               "cpu_offload_pin_memory", "use_orig_params", "state_dict_type", "final_state_dict_type", "auto_wrap_policy",
               "transformer_layer_cls_to_wrap", "min_num_params", "reshard_after_forward", "mixed_precision_policy")


def owns(data: Mapping[str, Any]) -> bool:
    return "base_model" in data


def schema() -> "Schema":
    data = shipped(MODULE)
    aliases = {alias: data["keys"][name] for alias, name in data["aliases"].items()}
    return schema_of(MODULE, {**data["keys"], **aliases})


def default(data: Mapping[str, Any], key: str) -> Any:
    return schema().defaults.get(key)


def read(reading: "Reading", file: ConfigFile) -> None:
    """The options of an axolotl config."""
    from planner.check.reading import Origin, _count, read_optimizer

    s = schema()
    data = file.data
    refuse_unknown(reading, file.path, s, data)
    value = lambda key: s.value(data, key)  # noqa: E731
    given = lambda key: key in data  # noqa: E731
    problems = [f"{key} ({why} not modelled)" for key, why in UNMODELLED.items() if value(key) not in (None, False, [], {}, "")]
    if value("gradient_checkpointing") not in (True, False, None):
        problems.append(f"gradient_checkpointing {value('gradient_checkpointing')} (offloaded checkpoints are not modelled)")
    if problems:
        raise UnsupportedError(f"{file.path}: {'; '.join(problems)}")
    reading.schema = s.name
    reading.trainer = "axolotl"
    if not value("base_model") or not isinstance(value("base_model"), str):
        raise InvalidConfigError(f"{file.path}: base_model must name the model (axolotl requires it)")
    reading.model = value("base_model")
    reading.origins["model"] = Origin(file=file.path, key="base_model", value=reading.model, given=True)
    for option, key in (("micro_batch", "micro_batch_size"), ("grad_accum", "gradient_accumulation_steps")):
        reading.set(option, _count(file, key, value(key)), file=file, key=key, given=given(key))
    reading.seq_len = _count(file, "sequence_len", value("sequence_len"))
    reading.origins["seq_len"] = Origin(file=file.path, key="sequence_len", value=reading.seq_len, given=given("sequence_len"))
    reading.set("packing", bool(value("sample_packing")), file=file, key="sample_packing", given=given("sample_packing"))
    reading.set("grad_ckpt", bool(value("gradient_checkpointing")), file=file, key="gradient_checkpointing",
                given=given("gradient_checkpointing"))
    read_optimizer(reading, file, "optimizer", value, given)
    read_switches(reading, file, "axolotl", value, given)
    _method(reading, file, value, given)
    _attention(reading, file, value)
    reading.device_rules.append(lambda r, gpu: _precision(r, file, value, given, gpu))
    _rope_scaling(reading, file, value)
    _sharding(reading, file, value)


#: axolotl's key for the model config's overrides (``overrides_of_model_config``, alias ``model_config``:
#: utils/schemas/deprecated.py l.147-153), set on the model's config one by one (loaders/utils.py l.201-203)
MODEL_CONFIG = "model_config"


def _rope_scaling(reading: "Reading", file: ConfigFile, value) -> None:
    """The RoPE scaling axolotl sets on the model's config: ``model_config: {rope_scaling: {type, factor}}``
    (or ``rope_parameters``, transformers 5's name; ``rope_type`` for ``type``). A top-level ``rope_scaling``
    is refused by axolotl itself (utils/schemas/deprecated.py l.36-43: "it should now be a key under
    model_config")."""
    if value("rope_scaling"):
        raise InvalidConfigError(f"{file.path}: axolotl refuses a top-level rope_scaling (deprecated): write it under "
                                 "model_config, e.g. model_config: {rope_scaling: {type: linear, factor: 2.0}}")
    overrides = value(MODEL_CONFIG) or value("overrides_of_model_config") or {}
    key = next((k for k in ("rope_scaling", "rope_parameters") if isinstance(overrides, Mapping) and overrides.get(k)), None)
    if key is None:
        return
    rope = overrides[key]
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else None
    if kind in (None, "default") or rope.get("factor") is None:
        return  # no scaling: the model's own rotary frequencies
    reading.set("rope_scaling", f"{kind}:{rope['factor']}", file=file, key=f"{MODEL_CONFIG}.{key}", raw=dict(rope))


def _sharding(reading: "Reading", file: ConfigFile, value) -> None:
    """DeepSpeed (``deepspeed``), or FSDP as axolotl runs it. FSDP is on where ``fsdp_config`` or the
    legacy ``fsdp`` list is (utils/trainer.py l.673 ``prepare_optim_env``); axolotl hands both to the HF
    Trainer's arguments (core/builders/base.py l.693-695), so the list is read as transformers reads it
    (``legacy_fsdp``), and sets the ``FSDP_*`` variables accelerate's plugin reads for what transformers
    leaves unset (utils/trainer.py l.597-628 ``setup_fsdp_envs``): ``offload_params`` is the CPU offload
    (FSDP_OFFLOAD_PARAMS), ``activation_checkpointing`` FSDP's checkpointing of each unit."""
    from planner.check.reading import _deepspeed_reference, _empty

    fsdp, settings = value("fsdp"), value("fsdp_config")
    if _empty(fsdp) and _empty(settings):
        if value("fsdp_version") is not None:  # config.py l.1680-1682: fsdp_version alone turns nothing on
            reading.notes.append("fsdp_version without fsdp_config: axolotl runs no FSDP")
        if value("deepspeed"):
            _deepspeed_reference(reading, file, value("deepspeed"))
        return
    if value("deepspeed"):  # validation.py l.1352-1355 refuses it with fsdp; with fsdp_config, FSDP's variables are set
        # and DeepSpeed's are not (utils/trainer.py l.673-676)
        raise InvalidConfigError(f"{file.path}: {'fsdp' if fsdp else 'fsdp_config'} and deepspeed are both set: keep one "
                                 "(axolotl runs FSDP and not DeepSpeed's ZeRO)")
    if not _empty(fsdp) and not isinstance(fsdp, list):  # config.py: fsdp is list[str] | None
        raise InvalidConfigError(f"{file.path}: fsdp must be a list of transformers' options, got {fsdp!r}: write "
                                 "[full_shard, auto_wrap], or drop it and keep fsdp_config")
    if settings is None:  # setup_fsdp_envs reads cfg.fsdp_config's fields, which a list alone leaves None
        raise InvalidConfigError(f"{file.path}: fsdp without fsdp_config: axolotl reads FSDP's settings from fsdp_config "
                                 "(utils/trainer.py setup_fsdp_envs): write fsdp_version: 2 and an fsdp_config mapping")
    _fsdp_config(reading, file, value, fsdp, settings)


def _fsdp_config(reading: "Reading", file: ConfigFile, value, fsdp: Any, settings: Any) -> None:
    """``fsdp_config`` (and the legacy list) planned through the HF reader's ``_fsdp``."""
    from planner.check.reading import _FSDP_VERSION, _fsdp, _fsdp_version, fsdp_settings, legacy_fsdp, wrap_note

    where, written = fsdp_settings(file, settings)
    config = {name: v for name, v in written.items() if name in FSDP_FIELDS}
    # the version: fsdp_version, else fsdp_config's, else FSDP1, which axolotl pins where fsdp_config holds
    # anything (validation.py l.1214-1233); an empty fsdp_config leaves it to transformers (its default, 2)
    version_key = "fsdp_version" if value("fsdp_version") or not config else where.get("version", "fsdp_version")
    default = 1 if config else _FSDP_VERSION["transformers"]
    version = _fsdp_version(file, version_key, (value("fsdp_version") if config else None) or config.get("version") or default)
    if dropped := [name for name in written if name not in config]:
        strategy = " (FSDP1 runs accelerate's default, FULL_SHARD)" if "sharding_strategy" in dropped and version == 1 else ""
        reading.notes.append(f"{', '.join(where[name] for name in dropped)}: not fields of axolotl's FSDPConfig, which "
                             f"drops them{strategy}")
    legacy_fsdp(file, fsdp, config, version)
    strategy = config.get("reshard_after_forward", True if version == 2 else "FULL_SHARD")
    strategy_key = where.get("reshard_after_forward", "fsdp")
    if version == 1 and isinstance(strategy, bool):
        # transformers passes FSDP1's reshard_after_forward on as a strategy's name (5.16.1, the one axolotl 0.19
        # pins: training_args.py l.2820-2822), and accelerate has none called "true" (1.13.0 utils/dataclasses.py
        # l.1850: KeyError; the same in the 5.24 and 1.15 installed here)
        raise InvalidConfigError(f"{file.path}: {strategy_key} is FSDP2's (true or false): with fsdp_version 1 remove it "
                                 "(FSDP1 shards fully), or set fsdp_version: 2")
    offload_key = where.get("offload_params", "fsdp_config.offload_params")
    # cpu_offload is the list's "offload" (FSDPConfig has no such field): transformers passes it to the plugin,
    # which reads FSDP_OFFLOAD_PARAMS (offload_params) only when it is unset (accelerate 1.13.0 utils/dataclasses.py
    # l.1861-1862)
    _fsdp(reading, file, version=version, strategy=strategy,
          offload=config.get("cpu_offload") or config.get("offload_params", False),
          checkpointing=config.get("activation_checkpointing"),
          keys=(version_key, strategy_key, offload_key, where.get("activation_checkpointing", "fsdp_config.activation_checkpointing")),
          given=lambda key: key in where.values() or key in file.data)
    wrap_note(reading, config)


def _attention(reading: "Reading", file: ConfigFile, value) -> None:
    """``attn_implementation`` (axolotl 0.19's key), or the legacy flags it maps to it
    (utils/schemas/config.py ``normalize_attn_implementation``: the two together are refused)."""
    from planner.check.reading import ATTENTION

    legacy = [key for key in _ATTENTION_KEYS if value(key)]
    implementation = value("attn_implementation")
    if legacy and implementation or len(legacy) > 1:
        raise InvalidConfigError(f"{file.path}: {', '.join(legacy + (['attn_implementation'] if implementation else []))}: "
                                 "give one attention (attn_implementation; axolotl refuses both)")
    if legacy:
        reading.set("attention", _ATTENTION_KEYS[legacy[0]], file=file, key=legacy[0], raw=True)
        return
    if implementation not in ATTENTION:
        raise UnsupportedError(f"{file.path}: attn_implementation {implementation} is not modelled: use sdpa, eager or "
                               "flash_attention_2")
    reading.set("attention", ATTENTION[implementation], file=file, key="attn_implementation", raw=implementation,
                given=implementation is not None)


def _method(reading: "Reading", file: ConfigFile, value, given) -> None:
    from planner.check.reading import _targets

    adapter = value("adapter")
    if adapter not in (None, "lora", "qlora"):
        raise UnsupportedError(f"{file.path}: adapter {adapter!r} is not modelled: lora, qlora or none (full fine-tuning)")
    if adapter == "qlora" and not value("load_in_4bit"):
        raise InvalidConfigError(f"{file.path}: adapter qlora needs load_in_4bit: true (axolotl refuses it too)")
    if adapter is None and value("load_in_4bit"):
        raise InvalidConfigError(f"{file.path}: load_in_4bit without an adapter trains 4-bit weights: set adapter: qlora")
    reading.set("method", adapter or "full", file=file, key="adapter", raw=adapter, given=given("adapter"))
    if adapter == "qlora":
        # axolotl runs peft's prepare_model_for_kbit_training (not under FSDP or ZeRO-3, where it skips
        # it), then casts every module named *norm* and the embeddings and head back to torch_dtype for
        # any LoRA/QLoRA adapter (src/axolotl/loaders/model.py _configure_embedding_dtypes,
        # _convert_embedding_modules_dtype): the non-4-bit parameters train 16-bit either way. Under FSDP the
        # 4-bit codes are stored as bfloat16 whatever torch_dtype is (0.19.0 loaders/model.py l.801-810; torch_dtype
        # only on its sharded loading path, l.1020): the same bytes, and FSDP2 gathers mixed dtypes as bytes (torch
        # distributed/fsdp/_fully_shard/_fsdp_collectives.py: a uint8 all-gather where the dtypes differ)
        reading.set("kbit_upcast", False, file=file, key="adapter", raw=adapter, given=False)
    if adapter is None:
        return
    reading.set("lora_r", value("lora_r"), file=file, key="lora_r", given=given("lora_r"))
    if value("lora_target_linear"):
        reading.set("lora_targets", ("all-linear",), file=file, key="lora_target_linear", raw=True)
    else:
        if value("lora_target_modules") is None:
            raise InvalidConfigError(f"{file.path}: name the modules LoRA adapts: lora_target_modules, or "
                                     "lora_target_linear: true (axolotl refuses neither)")
        reading.set("lora_targets", _targets(value("lora_target_modules")), file=file, key="lora_target_modules",
                    raw=value("lora_target_modules"))
    read_spelled(reading, file, "axolotl", lambda key: value(key) or 0.0, given)  # axolotl's default: None


def _precision(reading: "Reading", file: ConfigFile, value, given, gpu: "GPUSpec") -> None:
    """axolotl's ``resolve_dtype``: bf16 (``auto``: where the GPU has it), else fp16, else fp32."""
    bf16, fp16 = value("bf16"), value("fp16") or value("float16")
    if bf16 == "auto":
        bf16 = bool(gpu.bf16) and not fp16
        reading.notes.append(f"bf16: auto is {'on' if bf16 else 'off'} on {gpu.name} (axolotl resolve_dtype)")
    bf16 = bool(bf16) or bool(value("bfloat16"))
    half = "bf16" if bf16 else "fp16" if fp16 else None
    key = "bf16" if bf16 or not fp16 else "fp16"
    if str(reading.options["method"]) == "qlora":
        precision = f"{half}-mixed" if half else "fp32"
    else:
        precision = half or "fp32"
    reading.set("precision", precision, file=file, key=key, raw=value(key), given=given(key))


def write(config: "TrainConfig", *, like: Mapping[str, Any] | None = None,
          model_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keys of an axolotl config that say ``config`` (the model, data and schedule apart); ``like``: the file read, whose attention spelling (the
    legacy flags or ``attn_implementation``) is kept; ``model_config``: the model's config.json, whose rope_theta
    (and partial_rotary_factor) a RoPE scaling is written with (``_rope_keys``)."""
    from planner.optim import OPTIMIZERS

    method, precision = str(config.method), str(config.precision)
    half = precision.split("-")[0] if precision != "fp32" else None
    if precision == "fp8":  # axolotl's own fp8 switch is not the accelerate torchao recipe the plan counts
        raise UnsupportedError("axolotl: fp8 (accelerate's torchao float8 linears) has no spelling the planner writes")
    if (method == "qlora") != precision.endswith("-mixed") and half is not None:
        raise UnsupportedError(f"axolotl loads the model in the training dtype: {method} in {precision} has no spelling "
                               f"there ({'bf16-mixed' if method == 'qlora' else 'pure bf16 or fp32'} has)")
    out: dict[str, Any] = {"adapter": None if method == "full" else method, "load_in_4bit": method == "qlora"}
    if config.method.uses_adapters:
        all_linear = config.lora_all_linear
        out.update(lora_r=config.lora_r, lora_target_linear=True if all_linear else None,
                   lora_target_modules=None if all_linear else list(config.lora_targets))
    hf = OPTIMIZERS[config.optimizer]
    if hf.hf_args:
        raise UnsupportedError(f"optimizer {config.optimizer} needs {', '.join(hf.hf_args)} beside it, which the planner "
                               "does not write for axolotl")
    out.update(micro_batch_size=config.micro_batch, gradient_accumulation_steps=config.grad_accum,
               sequence_len=config.seq_len, sample_packing=config.packing, gradient_checkpointing=config.grad_ckpt,
               optimizer=hf.hf_optim, bf16=half == "bf16", fp16=half == "fp16")
    if like is not None and any(like.get(key) for key in _ATTENTION_KEYS):  # the file's spelling: axolotl refuses both
        out.update({key: str(config.attention) == name for key, name in _ATTENTION_KEYS.items()})
    else:
        from planner.check.reading import ATTENTION

        out["attn_implementation"] = next(k for k, v in ATTENTION.items() if k and v == str(config.attention))
    if config.rope_scaling:
        out[MODEL_CONFIG] = _rope_keys(config, model_config)
    if missing := unexpressible(config, "axolotl"):
        raise UnsupportedError(f"axolotl's core config has no key for {', '.join(missing)}")
    return out | trainer_values(config, "axolotl", adapters=config.method.uses_adapters) | _fsdp_keys(config, like)


def _rope_keys(config: "TrainConfig", model_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model_config`` for a RoPE scaling: axolotl sets each of its keys on the model's config (loaders/utils.py
    l.201-203, ``setattr``) before the model is built, and under transformers 5 the ``rope_scaling`` setter replaces
    rope_parameters whole (configuration_utils.py l.724-733). So the keys are what train.py's ``scale_rope`` sets
    (``planner.emit.settings.scaled_model_config``): the whole dict, with the model's rope_theta (and
    partial_rotary_factor) and yarn's and llama3's pretraining length, and the extended max_position_embeddings;
    without the model's config (planner check's rewrite of a file) the type and factor alone."""
    from planner.emit.settings import rope_parameters, scaled_model_config

    if model_config is None:
        return {"rope_scaling": rope_parameters(config)}
    scaled = scaled_model_config(config, model_config)
    return {"rope_scaling": scaled.pop("rope_parameters"), **scaled}


def _fsdp_keys(config: "TrainConfig", like: Mapping[str, Any] | None) -> dict[str, Any]:
    """An FSDP plan's settings (its scheme's ``fsdp_settings``, in transformers' names) as axolotl's keys:
    the version at the top (docs/multi-gpu.qmd, "Migrating from FSDP1 to FSDP2"), the CPU offload as
    ``offload_params``, the rest in ``fsdp_config`` where ``FSDPConfig`` has the field. A new file
    (no ``like``) checkpoints with FSDP's own wrapper and the model's off (both would gather each layer
    twice: transformers issue 30404); a file read keeps its own (``trainers.key_changes``)."""
    spec = config.sharding.spec
    if not hasattr(spec, "fsdp_settings"):
        return {}
    settings = dict(spec.fsdp_settings(config))
    version = settings.pop("version")
    settings["offload_params"] = settings.pop("cpu_offload")
    if version == 1:  # FSDP1's strategy by name, which axolotl's boolean field cannot say (accelerate's FULL_SHARD runs)
        settings.pop("reshard_after_forward")
    out = {"fsdp_version": version, "fsdp_config": {k: v for k, v in settings.items() if k in FSDP_FIELDS}}
    return out if like is not None else out | {"gradient_checkpointing": False}


__all__ = ["KIND", "LAUNCH", "default", "owns", "read", "schema", "write"]
