"""Write the schemas ``planner check`` reads axolotl, LLaMA-Factory and torchtune configs with
(planner/data/trainers/*.json), from the trainers' own released code.

None of the three installs cleanly beside the planner (``pip install axolotl`` pulls ~180
packages and moves transformers, pydantic and trl to other versions; LLaMA-Factory 0.9.5 caps
transformers at 5.6.0 and trl at 0.24; torchtune 0.6.1 needs a torchao built for the installed
torch), so CI reads these files. Run this where the trainers are installed, e.g.::

    python -m venv --system-site-packages /tmp/venv-trainers
    /tmp/venv-trainers/bin/pip install --no-deps axolotl==0.19.0 llamafactory==0.9.5 torchtune==0.6.1 \
        torchao==0.17.0 omegaconf sentencepiece tiktoken
    DISABLE_VERSION_CHECK=1 /tmp/venv-trainers/bin/python bench/trainer_schemas.py

Every file holds each key the trainer reads with its default, the trainer's version and the
source each key came from:

- axolotl: the fields of ``AxolotlInputConfig`` (axolotl/utils/schemas/config.py, a pydantic
  model), and the aliases pydantic accepts for them;
- LLaMA-Factory: the fields of the five dataclasses ``llamafactory-cli train`` parses a YAML into
  (llamafactory/hparams/parser.py ``_TRAIN_ARGS``: ModelArguments, DataArguments,
  TrainingArguments (transformers' Seq2SeqTrainingArguments with LLaMA-Factory's own),
  FinetuningArguments, GeneratingArguments);
- torchtune: per recipe, the top-level keys the recipe's code reads from its config (each
  ``cfg.get("key", default)``, ``cfg.key`` and ``cfg["key"]`` in recipes/<recipe>.py) and the keys
  its shipped configs hold; and the signature (parameters and defaults) of every ``_component_``
  a config may name for the model, the optimizer and the loss.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import json
import pkgutil
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "planner" / "data" / "trainers"
#: the torchtune recipes ``planner check`` plans (supervised fine-tuning, one device or several)
RECIPES = ("full_finetune_single_device", "full_finetune_distributed", "lora_finetune_single_device",
           "lora_finetune_distributed")
#: the sections of a torchtune config whose ``_component_`` changes memory: their signatures are kept
COMPONENT_SECTIONS = ("model", "optimizer", "loss")


def plain(value: Any) -> Any:
    """A default as JSON holds it: an enum as its value, anything else JSON cannot hold as its repr."""
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def dataclass_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = plain(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = plain(field.default_factory())
        else:
            out[field.name] = None
    return out


def axolotl() -> dict[str, Any]:
    import axolotl
    from axolotl.utils.schemas.config import AxolotlInputConfig
    from pydantic_core import PydanticUndefined

    keys, required, aliases = {}, [], {}
    for name, field in AxolotlInputConfig.model_fields.items():
        if field.default is PydanticUndefined and field.default_factory is None:
            required.append(name)
            keys[name] = None
        else:
            keys[name] = plain(field.get_default(call_default_factory=True))
        if field.alias and field.alias != name:
            aliases[field.alias] = name
    return {"trainer": "axolotl", "version": axolotl.__version__, "schema": "AxolotlInputConfig",
            "source": "axolotl/utils/schemas/config.py AxolotlInputConfig (pydantic model_fields)",
            "keys": keys, "required": sorted(required), "aliases": aliases}


def llama_factory() -> dict[str, Any]:
    import llamafactory
    import transformers
    from llamafactory.hparams import parser

    keys: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for cls in parser._TRAIN_ARGS:
        for name, default in dataclass_defaults(cls).items():
            keys.setdefault(name, default)
            owners.setdefault(name, cls.__name__)
    return {"trainer": "llama-factory", "version": llamafactory.__version__,
            "schema": " + ".join(c.__name__ for c in parser._TRAIN_ARGS),
            "source": "llamafactory/hparams/parser.py _TRAIN_ARGS (dataclasses; TrainingArguments subclasses "
                      f"transformers {transformers.__version__} Seq2SeqTrainingArguments)",
            "keys": keys, "owner": owners}


def _recipe_keys(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The top-level keys a torchtune recipe reads from ``cfg``, with the default of ``cfg.get``,
    and those it reads as ``cfg.key``/``cfg["key"]`` only (OmegaConf raises ConfigAttributeError
    when such a key is missing: the config must hold it)."""
    keys: dict[str, Any] = {}
    got: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "cfg" and node.args \
                and isinstance(node.args[0], ast.Constant):
            default = None
            if len(node.args) > 1:
                try:
                    default = ast.literal_eval(node.args[1])
                except ValueError:
                    default = ast.unparse(node.args[1])
            keys[node.args[0].value] = default
            got.add(node.args[0].value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg" \
                and node.attr not in ("get", "pop", "items", "keys"):
            keys.setdefault(node.attr, None)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "cfg" \
                and isinstance(node.slice, ast.Constant):
            keys.setdefault(node.slice.value, None)
    return keys, sorted(set(keys) - got)


def _signature(path: str) -> dict[str, Any]:
    from torchtune.config._utils import _get_component_from_path

    target = _get_component_from_path(path)
    params = inspect.signature(target).parameters
    return {name: None if p.default is inspect.Parameter.empty else plain(p.default) for name, p in params.items()
            if name not in ("self", "params", "args", "kwargs")}


def torchtune() -> dict[str, Any]:
    import torchtune
    import torchtune.models
    import yaml
    from torchtune._recipe_registry import get_all_recipes

    root = Path(torchtune.__file__).parent.parent / "recipes"  # the wheel installs them beside torchtune
    out_recipes, named, models = {}, set(), {}
    for recipe in get_all_recipes():
        if recipe.name not in RECIPES:
            continue
        keys, required = _recipe_keys(root / recipe.file_path)
        configs = {}
        for config in recipe.configs:
            data = yaml.safe_load((root / "configs" / config.file_path).read_text())
            for key in data:
                configs.setdefault(key, config.name)
            for section in COMPONENT_SECTIONS:
                if isinstance(data.get(section), dict) and "_component_" in data[section]:
                    named.add(data[section]["_component_"])
            _model_of(data, models)
        out_recipes[recipe.name] = {"source": f"recipes/{recipe.file_path}", "keys": keys, "required": required,
                                    "config_keys": {k: v for k, v in configs.items() if k not in keys},
                                    "configs": [c.name for c in recipe.configs]}
    components, skipped = {}, {}
    for info in pkgutil.iter_modules(torchtune.models.__path__):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"torchtune.models.{info.name}")
        except ImportError as exc:  # the vision models need torchvision: not language models the planner has
            skipped[f"torchtune.models.{info.name}"] = str(exc)
            continue
        for name in getattr(module, "__all__", ()):
            if name.startswith(("lora_", "qlora_")) or _is_model_builder(module, name):
                components[f"torchtune.models.{info.name}.{name}"] = _signature(f"torchtune.models.{info.name}.{name}")
    for path in sorted(named - set(components)):  # the optimizers and losses the shipped configs name
        try:
            components[path] = _signature(path)
        except Exception as exc:  # noqa: BLE001 - torchtune's InstantiationError, or the package's own import error
            skipped[path] = str(exc).splitlines()[0]
    return {"trainer": "torchtune", "version": torchtune.__version__,
            "source": "recipes/<recipe>.py (the keys each recipe reads from cfg), recipes/configs (the keys its "
                      "configs hold), inspect.signature of each _component_",
            "recipes": out_recipes, "components": components, "skipped": skipped, "models": models}


def _model_of(config: dict[str, Any], models: dict[str, Any]) -> None:
    """A shipped config's model: the HF checkpoint folder it reads (``checkpointer.checkpoint_dir``,
    where its ``tune download`` put the HF release), the full builder of its model, and its
    tokenizer and checkpointer sections (``planner emit --for torchtune`` writes them)."""
    checkpointer, tokenizer = config.get("checkpointer") or {}, config.get("tokenizer") or {}
    folder = str(checkpointer.get("checkpoint_dir", "")).rstrip("/").rsplit("/", 1)[-1]
    if "HFCheckpointer" not in str(checkpointer.get("_component_")) or not folder:
        return
    module, _, builder = config["model"]["_component_"].rpartition(".")
    builder = builder.removeprefix("qlora_").removeprefix("lora_")
    keep = ("_component_", "checkpoint_files", "model_type")
    models.setdefault(folder, {"model": f"{module}.{builder}", "checkpointer": {k: checkpointer[k] for k in keep if k in checkpointer},
                               "tokenizer": {k: v for k, v in tokenizer.items() if k != "max_seq_len"}})


def _is_model_builder(module: Any, name: str) -> bool:
    """A builder of a whole model (returns a TransformerDecoder), not a tokenizer or a part."""
    target = getattr(module, name)
    if not callable(target) or isinstance(target, type):
        return False
    returns = inspect.signature(target).return_annotation
    return "TransformerDecoder" in str(returns) and not name.startswith("_")


GENERATORS = {"axolotl": axolotl, "llama_factory": llama_factory, "torchtune": torchtune}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trainers", nargs="*", help=f"some of {', '.join(GENERATORS)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.trainers) - set(GENERATORS)
    if unknown:
        parser.error(f"no schema for {', '.join(sorted(unknown))}: name some of {', '.join(GENERATORS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.trainers or GENERATORS:
        data = {**GENERATORS[name](), "generated_by": "bench/trainer_schemas.py"}
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
        print(f"{path}: {name} {data['version']}")


if __name__ == "__main__":
    main()
