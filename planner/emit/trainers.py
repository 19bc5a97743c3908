"""``planner emit --for trl|axolotl|llama-factory|torchtune``: a plan as the config file the trainer
runs, with its launch line.

The keys that say the plan are each trainer's ``write`` (``planner.check.<trainer>``), the ones
``planner check`` reads the file back with, so an emitted file checks back to the plan; TRL's are
the HF arguments ``planner emit`` writes for train.py (``planner.emit.settings``) with TRL's
model and adapter keys. The rest (data, schedule, output) is the least the trainer needs to run,
each as its own docs' example writes it (cited where written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.errors import MissingDependencyError, UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import TrainConfig
    from planner.modelspec import ModelSpec

#: the trainers ``--for`` takes (hf: train.py and its files, ``planner.emit.plan_files``)
TARGETS = ("hf", "trl", "axolotl", "llama-factory", "torchtune")
#: the config file each writes
FILE_NAMES = {"trl": "sft.yaml", "axolotl": "axolotl.yaml", "llama-factory": "llama_factory.yaml",
              "torchtune": "torchtune.yaml"}
#: the dataset when ``--dataset`` names none: each trainer's docs' example dataset
EXAMPLE_DATASET = {"trl": "trl-lib/Capybara", "axolotl": "tatsu-lab/alpaca", "llama-factory": "alpaca_en_demo"}


def trainer_files(target: str, *, config: "TrainConfig", spec: "ModelSpec", model: str, dataset: str | None,
                  on_cpu: bool) -> tuple[dict[str, str], str]:
    """(file name -> text, the launch line) of ``config`` for ``target``."""
    if target not in FILE_NAMES:
        raise UnsupportedError(f"--for {target}: use one of {', '.join(TARGETS)}")
    try:
        return _files(target, config=config, spec=spec, model=model, dataset=dataset, on_cpu=on_cpu)
    except UnsupportedError as exc:
        raise UnsupportedError(f"--for {target}: {exc}; emit another --rank, plan again with a precision it has "
                               "(planner suggest --precision), or emit --for hf") from None


def _files(target: str, *, config: "TrainConfig", spec: "ModelSpec", model: str, dataset: str | None,
           on_cpu: bool) -> tuple[dict[str, str], str]:
    from planner.emit import settings

    name = FILE_NAMES[target]
    files: dict[str, str] = {}
    sharding = settings.sharding_files(config, spec=spec, on_cpu=on_cpu) if target != "torchtune" else {}
    if target == "trl":
        data = _trl(config, spec=spec, model=model, dataset=dataset, on_cpu=on_cpu)
        files["accelerate_config.yaml"] = settings.to_yaml(settings.accelerate_config(config, on_cpu=on_cpu))
        launch = f"accelerate launch --config_file accelerate_config.yaml -m trl.scripts.sft --config {name}"
    elif target == "axolotl":
        data = _axolotl(config, spec=spec, model=model, dataset=dataset, deepspeed=next(iter(sharding), None))
        launch = _launch("axolotl", file=name) if config.gpus == 1 else \
            f"accelerate launch --num_processes {config.gpus} -m axolotl.cli.train {name}"
    elif target == "llama-factory":
        data = _llama_factory(config, model=model, dataset=dataset, deepspeed=next(iter(sharding), None))
        launch = ("" if config.gpus == 1 else f"FORCE_TORCHRUN=1 NPROC_PER_NODE={config.gpus} ") + \
            _launch("llama-factory", file=name)
    else:
        data, launch = _torchtune(config, spec=spec, name=name)
    files[name] = _yaml(data)
    files.update({file: _json(content) for file, content in sharding.items()})
    return files, launch


def _trl(config: "TrainConfig", *, spec: "ModelSpec", model: str, dataset: str | None, on_cpu: bool) -> dict[str, Any]:
    """``trl sft --config`` keys (TRL docs, "Command Line Interface"): ScriptArguments' dataset,
    the HF arguments train.py gets, SFTConfig's sequence and packing, ModelConfig's model and adapter."""
    from planner.config import Method
    from planner.emit import settings

    # TRL's SFTTrainer runs no k-bit preparation (trl 1.16 trainer/sft_trainer.py l.806-869: get_peft_model
    # alone), so a QLoRA plan with peft's fp32 upcast loads its non-4-bit parameters in fp32 itself, the
    # dtype planner check reads back as the upcast (planner.check.reading _precision_and_method)
    upcast = config.method is Method.QLORA and config.kbit_upcast
    out: dict[str, Any] = {"model_name_or_path": model, "dataset_name": dataset or EXAMPLE_DATASET["trl"],
                           **settings.training_arguments(config, on_cpu=on_cpu), "max_length": config.seq_len,
                           "packing": config.packing, "dtype": "float32" if upcast else settings.model_dtype(config),
                           "attn_implementation": config.attention.hf_name}
    if config.method.uses_adapters:
        lora = settings.lora_config(config, spec=spec)
        from planner.request import FIELDS

        out.update(use_peft=True, lora_r=lora["r"], lora_alpha=lora["lora_alpha"],
                   lora_target_modules=lora["target_modules"])
        # the request fields TRL's ModelConfig and PEFT's LoraConfig both spell (RequestField.trl, .peft)
        out.update({f.trl: lora[f.peft] for f in FIELDS.values() if f.trl and f.peft})
    if config.method is Method.QLORA:
        bnb = settings.bnb_config(config)
        out.update(load_in_4bit=True, bnb_4bit_quant_type=bnb["bnb_4bit_quant_type"],
                   use_bnb_nested_quant=bnb["bnb_4bit_use_double_quant"])
    return out


def _axolotl(config: "TrainConfig", *, spec: "ModelSpec", model: str, dataset: str | None,
             deepspeed: str | None) -> dict[str, Any]:
    """axolotl's keys (examples/llama-3/qlora.yml's layout): the model, a dataset, the plan's keys."""
    from planner.check import axolotl
    from planner.emit import settings

    out: dict[str, Any] = {"base_model": model,
                           "datasets": [{"path": dataset or EXAMPLE_DATASET["axolotl"], "type": "alpaca"}],
                           "output_dir": settings.OUTPUT_DIR, **axolotl.write(config, model_config=spec.config), "num_epochs": 1,
                           "learning_rate": settings.LEARNING_RATE, "lr_scheduler": "cosine"}
    if config.method.uses_adapters:
        out["lora_alpha"] = config.lora_r * settings.LORA_ALPHA_PER_RANK
    if deepspeed:
        out["deepspeed"] = deepspeed
    return {k: v for k, v in out.items() if v is not None}


def _llama_factory(config: "TrainConfig", *, model: str, dataset: str | None, deepspeed: str | None) -> dict[str, Any]:
    """LLaMA-Factory's keys (examples/train_lora/llama3_lora_sft.yaml's sections)."""
    from planner.check import llama_factory
    from planner.emit import settings

    out: dict[str, Any] = {"model_name_or_path": model, "stage": "sft", "do_train": True,
                           # its dataset_info.json names; "default" is the template of any model
                           "dataset": dataset or EXAMPLE_DATASET["llama-factory"], "template": "default",
                           "output_dir": settings.OUTPUT_DIR, **llama_factory.write(config),
                           "learning_rate": settings.LEARNING_RATE, "num_train_epochs": 1.0, "report_to": "none"}
    if config.method.uses_adapters:
        out["lora_alpha"] = config.lora_r * settings.LORA_ALPHA_PER_RANK
    if deepspeed:
        out["deepspeed"] = deepspeed
    return {k: v for k, v in out.items() if v is not None}


def _torchtune(config: "TrainConfig", *, spec: "ModelSpec", name: str) -> tuple[dict[str, Any], str]:
    """A single-device recipe config laid out as torchtune's own (recipes/configs/llama3_2/
    1B_lora_single_device.yaml), the model's builder, tokenizer and checkpointer taken from the
    torchtune config that reads the same HF release (planner/data/trainers/torchtune.json)."""
    from planner.check import torchtune
    from planner.check.trainers import nested
    from planner.emit import settings

    release = _torchtune_release(spec)
    folder, known = release
    flat = torchtune.write(config, like={"model": {"_component_": known["model"]}})
    recipe = torchtune.recipe_of({"model": {"_component_": flat["model._component_"]}})
    data = nested({"output_dir": f"/tmp/torchtune/{settings.OUTPUT_DIR}", **flat})
    data["tokenizer"] = {**known["tokenizer"], **data["tokenizer"]}
    data["checkpointer"] = {**known["checkpointer"], "checkpoint_dir": f"/tmp/{folder}/", "recipe_checkpoint": None,
                            "output_dir": "${output_dir}"}
    data["dataset"] = {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", **data["dataset"]}
    data["optimizer"]["lr"] = settings.LEARNING_RATE
    # the rest as 1B_lora_single_device.yaml writes it: every key the recipe reads with no default
    # the loss chunked as the plan counts it (its num_output_chunks: torchtune.write)
    data.update(loss={"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", **data.get("loss", {})}, epochs=1, max_steps_per_epoch=None,
                seed=None, shuffle=True, device="cuda", resume_from_checkpoint=False,
                metric_logger={"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": "${output_dir}/logs"})
    if recipe == "lora_finetune_single_device":  # (the full recipe's own keys: torchtune.write)
        data["lr_scheduler"] = {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                                "num_warmup_steps": 100}
    missing = [k for k in torchtune.required(recipe) if k not in data]
    assert not missing, f"emit writes every key {recipe} reads with no default: {missing}"
    launch = f"tune download {spec.id} --output-dir /tmp/{folder} && " + _launch("torchtune", file=name, recipe=recipe)
    return data, launch


def _torchtune_release(spec: "ModelSpec") -> tuple[str, dict[str, Any]]:
    """The HF release folder a torchtune config reads for this model (a release or its base)."""
    from planner.check.trainers import shipped

    models = shipped("torchtune")["models"]
    bare = spec.id.rsplit("/", 1)[-1].lower()
    for folder, known in models.items():
        name = folder.lower()
        if name == bare or name.removesuffix("-instruct") == bare or name == bare.removesuffix("-instruct"):
            return folder, known
    raise UnsupportedError(f"torchtune 0.6.1 has no single-device config for {spec.id}: its configs read "
                           f"{', '.join(sorted(models))}")


def _launch(target: str, **names: str) -> str:
    """The trainer's run line (its module's ``LAUNCH``)."""
    from planner.check.trainers import trainer

    return trainer(target).LAUNCH.format(**names)


def _yaml(data: dict[str, Any]) -> str:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with transformers and accelerate
        raise MissingDependencyError("writing a trainer's YAML needs PyYAML: pip install pyyaml") from None
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=2) + "\n"


__all__ = ["EXAMPLE_DATASET", "FILE_NAMES", "TARGETS", "trainer_files"]
