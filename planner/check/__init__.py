"""``planner check FILE``: an existing training setup, read with its trainer's own schema, planned
as it stands (fits or not, peak, where it peaks, OOM risk), and the closest change that makes it
fit (or, when it fits, faster) written back as a diff of its files' own keys.

The answer is the library's: the configuration is estimated by ``planner.estimation`` (what
``planner estimate`` runs), the change comes from ``planner.planning.make_plan`` (what
``planner suggest`` runs) at the file's global batch, narrowed back towards the file by
re-estimating each changed option at the file's value (``closest``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from planner.check import files as kinds
from planner.check.building import options_of, sharding, train_config
from planner.check.reading import Reading
from planner.check.result import Change, CheckResult, KeyChange
from planner.errors import InvalidConfigError, PlannerError

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.modelspec import ModelSpec

#: the files looked for beside the arguments file, as peft's save_pretrained and ``planner emit`` name them
BESIDE = {"adapter_config.json": kinds.ADAPTER, "bnb_config.json": kinds.BNB}


def read_files(paths: Sequence[str | Path], *, trainer: str | None = None) -> Reading:
    """Every file named, the DeepSpeed JSON they reference and the adapter/bnb configs beside the
    arguments file, read into one ``Reading``. ``trainer``: "hf" or "trl" reads the arguments with
    that trainer's schema (default: TRL's when the file holds a key only TRL has); "axolotl",
    "llama-factory" or "torchtune" reads it as that trainer's YAML (default: by its keys)."""
    if not paths:
        raise InvalidConfigError("planner check needs a training config file: planner check FILE --gpu G")
    reading = Reading()
    for path in paths:
        reading.files.append(kinds.read(path))
    _one_of_each(reading)
    from planner.check.trainers import kind_of

    args = reading.by_kind(kinds.TRAINING_ARGS)
    if args is not None and kind_of(args.data) is None and trainer not in _TRAINER_KINDS.values():
        present = {f.kind for f in reading.files}
        for name, kind in BESIDE.items():
            beside = Path(args.path).parent / name
            if kind not in present and beside.is_file():
                reading.files.append(kinds.read(beside))
    return _read(reading, trainer=trainer)


def read_texts(texts: Mapping[str, str], *, trainer: str | None = None) -> Reading:
    """``read_files`` of files sent as text (name -> text): a file another names is looked up among
    them by its base name, and nothing is read from disk."""
    if not texts:
        raise InvalidConfigError("send at least one training config file")
    sent = {Path(name).name: kinds.parse(name, text) for name, text in texts.items()}

    def among_sent(ref: str, file: kinds.ConfigFile, key: str) -> kinds.ConfigFile:
        if Path(ref).name not in sent:
            raise InvalidConfigError(f"{file.path}: {key} names {ref}, which was not sent: send it too "
                                     f"(files: {', '.join(sorted(sent))})")
        return sent[Path(ref).name]

    reading = Reading(resolve=among_sent)
    reading.files.extend(sent.values())
    _one_of_each(reading)
    return _read(reading, trainer=trainer)


def _one_of_each(reading: Reading) -> None:
    seen: dict[str, str] = {}
    for f in reading.files:
        if f.kind in seen:
            raise InvalidConfigError(f"{f.path} and {seen[f.kind]} are both a {f.kind}: give one")
        seen[f.kind] = f.path


def _trainer_names() -> dict[str, str]:
    from planner.check.trainers import MODULES, trainer

    return {trainer(name).KIND: name for name in MODULES}


#: a trainer's file kind -> its ``--trainer`` name
_TRAINER_KINDS = _trainer_names()


def _trainer_kind(reading: Reading, trainer: str | None) -> None:
    """An arguments file that is an axolotl, LLaMA-Factory or torchtune YAML, by its keys or by
    ``--trainer``, takes that trainer's kind."""
    from planner.check.trainers import kind_of

    forced = next((k for k, name in _TRAINER_KINDS.items() if name == trainer), None)
    if trainer in ("hf", "trl"):
        return
    for i, f in enumerate(reading.files):
        kind = forced or kind_of(f.data) if f.kind == kinds.TRAINING_ARGS else None
        if kind is not None:
            reading.files[i] = kinds.ConfigFile(path=f.path, kind=kind, data=f.data)


def _read(reading: Reading, *, trainer: str | None) -> Reading:
    from planner.check import reading as readers
    from planner.check import schemas

    _trainer_kind(reading, trainer)
    own = next((f for f in reading.files if f.kind in _TRAINER_KINDS), None)
    if own is not None:
        from planner.check.trainers import trainer as trainer_module

        trainer_module(_TRAINER_KINDS[own.kind]).read(reading, own)
    args = reading.by_kind(kinds.TRAINING_ARGS)
    if args is not None:
        readers.training_args(reading, args, schemas.training_arguments(args.data, trainer=trainer))
    accel = reading.by_kind(kinds.ACCELERATE)
    if accel is not None:
        readers.accelerate(reading, accel, schemas.accelerate_config())
    for f in list(reading.files):
        if f.kind == kinds.BNB:
            readers.bnb(reading, f, schemas.bnb_config())
    for f in list(reading.files):
        if f.kind == kinds.ADAPTER:
            readers.adapter(reading, f, schemas.lora_config())
    for f in list(reading.files):
        if f.kind == kinds.DEEPSPEED:
            readers.deepspeed(reading, f)
    if args is None and accel is None and own is None:
        raise InvalidConfigError(f"{reading.files[0].path} is a {reading.files[0].kind}: give the training arguments "
                                 "(TrainingArguments/SFTConfig JSON or YAML, an axolotl, LLaMA-Factory or torchtune "
                                 "config) or the accelerate config it goes with")
    fsdp = reading.by_kind(kinds.FSDP)
    if fsdp is not None and "sharding" not in reading.options:
        raise InvalidConfigError(f"{fsdp.path} is an FSDP config that no arguments file names: set fsdp: true and "
                                 f"fsdp_config: {Path(fsdp.path).name} in the training arguments")
    if "micro_batch" not in reading.origins:
        raise InvalidConfigError("no file says the per-device batch: give the training arguments file too "
                                 "(per_device_train_batch_size), or train_micro_batch_size_per_gpu in the DeepSpeed JSON")
    return reading


def check(paths: Sequence[str | Path], *, gpu: str, model: str | None = None, gpus: int | None = None,
          seq_len: int | None = None, gpu_mem_bytes: int | None = None, cpu_mem_bytes: int | None = None,
          calibration: "Calibration | None" = None, spec: "ModelSpec | None" = None,
          trainer: str | None = None) -> CheckResult:
    """Read the files, estimate their configuration on ``gpu`` and find the closest change.
    ``model``/``gpus``/``seq_len`` override what the files say; ``spec``: an already resolved model."""
    return check_reading(read_files(paths, trainer=trainer), gpu=gpu, model=model, gpus=gpus, seq_len=seq_len, gpu_mem_bytes=gpu_mem_bytes,
                         cpu_mem_bytes=cpu_mem_bytes, calibration=calibration, spec=spec)


def check_reading(reading: Reading, *, gpu: str, model: str | None = None, gpus: int | None = None,
                  seq_len: int | None = None, gpu_mem_bytes: int | None = None, cpu_mem_bytes: int | None = None,
                  calibration: "Calibration | None" = None, spec: "ModelSpec | None" = None) -> CheckResult:
    from planner.calibration import apply_calibration
    from planner.estimation import default_seq_len, estimate_configuration, resolve
    from planner.gpus import get_gpu

    name = model or reading.model
    if spec is None and not name:
        raise InvalidConfigError("no file names the model: give --model (a catalog id or a config.json), or the "
                                 "file's model key (model_name_or_path; axolotl's base_model; torchtune's "
                                 "checkpointer.checkpoint_dir holding the model's config.json)")
    if spec is None:
        spec, device = resolve(model=name, gpu=gpu, gpu_mem_bytes=gpu_mem_bytes, calibration=calibration)
    else:
        device = apply_calibration(get_gpu(gpu, memory_bytes=gpu_mem_bytes), calibration)
    for rule in reading.device_rules:
        rule(reading, device)
    seq = seq_len or reading.seq_len
    for rule in reading.model_rules:
        rule(reading, spec, seq or default_seq_len(spec))
    notes = list(reading.notes)
    if seq is None:
        seq = default_seq_len(spec)
        notes.append(f"no file says the sequence length: planned at {seq} tokens (--seq-len to change it)")
    options = dict(reading.options)
    options["gpus"] = gpus or reading.gpus or 1
    if options.get("method") in ("lora", "qlora") and options.get("lora_targets") is None:
        options["lora_targets"] = peft_default_targets(spec)
        notes.append(f"no target modules: peft's default for {spec.model_type}, {', '.join(options['lora_targets'])} "
                     "(peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)")
    if gpus is None and reading.gpus is None:
        notes.append("no file says the number of GPUs: planned on 1 (--gpus N, or num_processes in an accelerate config)")
    if reading.buffers is not None and options.get("zero"):
        # the run reads the user's own DeepSpeed JSON: its buckets, DeepSpeed's defaults for the rest
        from planner.sharding.zero import users_sharding

        options["sharding"] = users_sharding(options["zero"], options.get("offload") or "none", reading.buffers,
                                             spec.hidden_size)
    try:
        config = train_config(spec, device, seq_len=seq, options=options)
    except PlannerError as exc:
        raise _in_file_terms(exc, reading) from None
    data, _memory = estimate_configuration(spec=spec, gpu=device, seq_len=seq, **options_of(config))
    from planner.check.closest import closest_change

    change, advice = closest_change(reading, spec=spec, device=device, config=config, estimate=data,
                                    calibration=calibration, cpu_mem_bytes=cpu_mem_bytes, gpu_mem_bytes=gpu_mem_bytes)
    origins = {k: {"file": o.file, "key": o.key, "value": o.value, "given": o.given} for k, o in reading.origins.items()}
    return CheckResult(files=tuple(f.path for f in reading.files), schema=reading.schema, config=config, estimate=data,
                       change=change, advice=tuple(advice), notes=tuple(notes), origins=origins)


def _in_file_terms(exc: PlannerError, reading: Reading) -> PlannerError:
    """A configuration error worded with options (``--precision bf16-mixed: ...``) with the file and
    key the option was read from, of the same error type."""
    import re

    match = re.match(r"--([a-z-]+)", str(exc))
    origin = reading.origins.get(match.group(1).replace("-", "_")) if match else None
    if origin is None:
        return exc
    where = f"{origin.file}: {origin.key}" + ("" if origin.given else " (the trainer's default, not in the file)")
    return type(exc)(f"{exc} [read from {where}]")


def peft_default_targets(spec: "ModelSpec") -> tuple[str, ...]:
    """What peft adapts when ``target_modules`` is None: its table by ``model_type`` (peft
    tuners_utils.py ``_prepare_adapter_config``); a model it has no entry for is an error there too."""
    from planner.errors import UnsupportedError

    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    except ImportError:  # pragma: no cover - peft comes with the workers extra
        raise UnsupportedError("the adapter names no target modules and peft is not installed to say its default: "
                               "write target_modules (e.g. all-linear)") from None
    kind = spec.wrapper_type or spec.model_type
    if kind not in defaults and spec.model_type not in defaults:
        raise UnsupportedError(f"the adapter names no target modules and peft has no default for {kind} (peft refuses "
                               "it too): write target_modules, e.g. all-linear")
    return tuple(defaults.get(kind) or defaults[spec.model_type])


def check_arguments(arguments: Mapping[str, Any] | Any, *, trainer: str | None = None, **kwargs: Any) -> CheckResult:
    """``check`` of arguments given as an object: a mapping of the file's keys (an axolotl,
    LLaMA-Factory or torchtune config's too), or a ``TrainingArguments``/``SFTConfig`` instance (its
    ``to_dict()``, the keys it was made with)."""
    from planner.check import reading as readers
    from planner.check import schemas

    if not isinstance(arguments, Mapping):
        to_dict = getattr(arguments, "to_dict", None)
        if to_dict is None:
            raise InvalidConfigError(f"check takes a path, a list of paths, a mapping of training arguments or a "
                                     f"TrainingArguments object, got {type(arguments).__name__}")
        arguments = {k: v for k, v in to_dict().items() if not k.startswith("_")}
    reading = Reading()
    file = kinds.ConfigFile(path="(arguments)", kind=kinds.TRAINING_ARGS, data=dict(arguments))
    reading.files.append(file)
    from planner.check.trainers import MODULES, kind_of

    if trainer in MODULES or (trainer is None and kind_of(file.data) is not None):  # an axolotl/LLaMA-Factory/torchtune mapping
        return check_reading(_read(reading, trainer=trainer), **kwargs)
    readers.training_args(reading, file, schemas.training_arguments(file.data, trainer=trainer))
    for f in list(reading.files):
        if f.kind == kinds.DEEPSPEED:
            readers.deepspeed(reading, f)
    return check_reading(reading, **kwargs)


__all__ = ["BESIDE", "Change", "CheckResult", "KeyChange", "check", "check_arguments", "check_reading", "read_files", "read_texts",
           "sharding", "train_config"]
