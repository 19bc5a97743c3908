"""The trainers whose whole run is one YAML file (axolotl, LLaMA-Factory, torchtune): their
schemas, and a change written back as that file's own keys.

None of the three installs cleanly beside the planner (bench/trainer_schemas.py says why), so
each schema is shipped as data, written by bench/trainer_schemas.py from the trainer's released
code: every key the trainer reads, its default, the trainer's version and the source file
(planner/data/trainers/*.json). Each trainer's module (``planner.check.axolotl``,
``llama_factory``, ``torchtune``) reads its file into the planner's options and writes a
configuration back as its keys (``write``); ``planner emit --for`` writes the same keys, so a
file emitted for a plan is read back as that plan.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from planner.check.schemas import Schema
from planner.errors import InvalidConfigError

if TYPE_CHECKING:  # pragma: no cover
    from planner.check.reading import Reading
    from planner.check.result import KeyChange
    from planner.config import TrainConfig

#: the trainer names ``--trainer`` and ``--for`` take -> their module under planner.check
MODULES = {"axolotl": "axolotl", "llama-factory": "llama_factory", "torchtune": "torchtune"}
#: where the shipped schemas lie
DATA = Path(__file__).resolve().parent.parent / "data" / "trainers"


@functools.cache
def shipped(module: str) -> Mapping[str, Any]:
    """The schema file bench/trainer_schemas.py wrote for a trainer."""
    return json.loads((DATA / f"{module}.json").read_text(encoding="utf-8"))


def trainer(name: str):
    """A trainer's module (``read``, ``write``, ``KIND``, ``LAUNCH``) by its ``--trainer`` name."""
    if name not in MODULES:
        raise InvalidConfigError(f"no trainer {name!r}: use one of {', '.join(MODULES)}")
    return importlib.import_module(f"planner.check.{MODULES[name]}")


def kind_of(data: Mapping[str, Any]) -> str | None:
    """The trainer whose file these keys are, by the key only its schema requires or has (torchtune:
    a ``model`` section naming its ``_component_``; axolotl: ``base_model``, which
    ``AxolotlInputConfig`` requires; LLaMA-Factory: ``finetuning_type`` or ``stage``, its
    ``FinetuningArguments``'), else None."""
    for name in MODULES:
        module = trainer(name)
        if module.owns(data):
            return module.KIND
    return None


def schema_of(module: str, keys: Mapping[str, Any], *, part: str = "") -> Schema:
    data = shipped(module)
    return Schema(name=f"{data['trainer']} {data['version']} {part or data.get('schema', '')}".strip(), defaults=keys)


def refuse_unknown(reading: "Reading", file_path: str, schema: Schema, data: Mapping[str, Any], *,
                   where: str = "") -> None:
    """Name every key the trainer's schema does not have (axolotl's pydantic model drops them
    silently, torchtune's recipes never read them): one with a value is an error (the run would not
    be the file's); one left empty (``debug:``, a key an older release had) is said in the notes."""
    if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
        raise InvalidConfigError(f"{file_path}: {where or 'the file '}must be a mapping of named settings, got {data!r:.80}")
    empty = [k for k in schema.unknown(data) if data[k] in (None, "")]
    if empty:
        reading.notes.append(f"{where}{', '.join(empty)}: not {'a key' if len(empty) == 1 else 'keys'} of {schema.name}; "
                             "empty, so nothing is lost")
    unknown = [k for k in schema.unknown(data) if k not in empty]
    if unknown:
        one = len(unknown) == 1
        raise InvalidConfigError(f"{file_path}: {where}{', '.join(unknown)} {'is not a key' if one else 'are not keys'} of "
                                 f"{schema.name}: fix the spelling or remove {'it' if one else 'them'}")


def dotted(data: Mapping[str, Any], key: str) -> Any:
    """``a.b`` of nested mappings (None where a part is missing)."""
    value: Any = data
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys as nested mappings, in their order."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


#: the FSDP keys of axolotl's file and of the HF arguments LLaMA-Factory's holds (the first part of a dotted key)
FSDP_KEYS = ("fsdp", "fsdp_config", "fsdp_version")


def key_changes(reading: "Reading", old: "TrainConfig", new: "TrainConfig", *,
                sharding: Callable[["TrainConfig"], tuple[int, str]]) -> "tuple[KeyChange, ...]":
    """The keys of the trainer's file that say ``new`` instead of ``old``: those whose value the
    trainer's ``write`` gives differently for the two, with the value the file holds (or the
    schema's default) as the old one; the sharding as the DeepSpeed JSON's keys (the file's
    ``deepspeed`` names it, as the HF arguments' does). A file that runs FSDP keeps its scheme (the
    search's ``spelled_schemes``): its offload and checkpointing go back to the keys they were read
    from (a prefixed key, the JSON ``fsdp_config`` names, FSDP's checkpointing or the model's)."""
    from planner.check.diff import sharding_changes
    from planner.check.result import KeyChange

    module = trainer(reading.trainer)
    file = reading.by_kind(module.KIND)
    before, after = module.write(old, like=file.data), module.write(new, like=file.data)
    fsdp = isinstance(sharding(old)[0], str)
    ckpt_key = getattr(module, "CHECKPOINTING", None)  # the key the trainer's own checkpointing is said by
    origin = reading.origins.get("grad_ckpt")
    by_origin = fsdp and origin is not None and (origin.file, origin.key) != (file.path, ckpt_key)
    skip = {k for k in [*before, *after] if fsdp and (k.split(".")[0] in FSDP_KEYS or by_origin and k == ckpt_key)}
    changes = [KeyChange(file=file.path, key=key, old=_held(file.data, key, module), new=after.get(key))
               for key in dict.fromkeys([*before, *after]) if before.get(key) != after.get(key) and key not in skip]
    if by_origin and old.grad_ckpt != new.grad_ckpt:
        changes.append(KeyChange(file=origin.file, key=origin.key, old=old.grad_ckpt, new=new.grad_ckpt))
    if sharding(old) != sharding(new):
        changes.extend(sharding_changes(reading, file, sharding(old), sharding(new)))
    return tuple(changes)


def _held(data: Mapping[str, Any], key: str, module) -> Any:
    value = dotted(data, key)
    return value if value is not None else module.default(data, key)


__all__ = ["DATA", "FSDP_KEYS", "MODULES", "dotted", "key_changes", "kind_of", "nested", "refuse_unknown", "read_spelled", "read_switches", "schema_of", "shipped",
           "trainer"]


def read_spelled(reading: "Reading", file, trainer_name: str, value: Callable[[str], Any],
                 given: Callable[[str], bool]) -> None:
    """The request fields the trainer's file spells by a key declared on them
    (``planner.request.RequestField.trainers``), read through that key: each a probability (the
    adapters' dropout), which ``TrainConfig`` range-checks; the switches and counts of a recipe are
    read where its reader knows the recipe reads them (torchtune's ``_recipe_settings``)."""
    from planner.check.reading import _probability
    from planner.request import trainer_keys

    for field, key in trainer_keys(trainer_name):
        if field.type is not float:
            continue
        reading.set(field.name, _probability(file, key, value(key)), file=file, key=key, given=given(key))


def read_switches(reading: "Reading", file, trainer_name: str, value: Callable[[str], Any],
                  given: Callable[[str], bool]) -> None:
    """The switches the trainer's file spells by a key declared on them (``RequestField.trainers``: axolotl's and
    LLaMA-Factory's ``torch_compile``), each read as on or off (unset: the key's default, off)."""
    from planner.request import trainer_keys

    for field, key in trainer_keys(trainer_name):
        if field.type is bool:
            reading.set(field.name, bool(value(key)), file=file, key=key, given=given(key))

