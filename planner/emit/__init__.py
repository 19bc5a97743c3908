"""Ready-to-run training files for a plan: ``planner emit`` and ``planner suggest --emit``.

``plan_files`` builds every file's text from a candidate, the model and the request (pure, no
I/O); ``write_plan_files`` takes a stored plan, resolves its model and writes them into a
directory, refusing to overwrite anything without ``force``. Each setting is the one the memory
model assumed (``planner.emit.settings``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Sequence

from planner.errors import PlannerError
from planner.files import discard, partial_of

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import TrainConfig
    from planner.modelspec import ModelSpec
    from planner.results import Candidate, Measurement, PlanRequest
    from planner.store import StoredCandidate, StoredPlan

#: every file ``plan_files`` can write, in the order PLAN.md lists them
FILE_NAMES = ("train.py", "training_args.json", "ds_config.json", "lora_config.json", "bnb_config.json",
              "accelerate_config.yaml", "PLAN.md")
#: every name ``--for`` any trainer writes: a directory emitted into again (--force) keeps no stale one
ALL_FILE_NAMES = (*FILE_NAMES, "sft.yaml", "axolotl.yaml", "llama_factory.yaml", "torchtune.yaml")
#: how train.py is run
HF_LAUNCH = "accelerate launch --config_file accelerate_config.yaml train.py --dataset {data}"


class OutputExistsError(PlannerError):
    """The output directory already holds files (nothing is overwritten without --force)."""


class OutputWriteError(PlannerError):
    """The output directory cannot be made or written (permissions, a read-only or virtual file
    system, a full disk); nothing of the files is left behind."""


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def plan_files(
    *, candidate: "Candidate", spec: "ModelSpec", request: "PlanRequest", plan_id: str = "-", rank: int = 1,
    dataset: str | None = None, measurements: "Sequence[Measurement]" = (), status: str = "planned",
    usable_bytes: int = 0,
) -> dict[str, str]:
    """File name -> text of every file for this candidate (only those its configuration uses)."""
    from planner.emit import settings
    from planner.emit.plan_md import render_plan_md
    from planner.emit.train_script import render_train_script
    from planner.gpus import get_gpu

    config = candidate.config
    on_cpu = get_gpu(request.gpu, memory_bytes=request.gpu_memory_bytes).is_cpu
    files: dict[str, str] = {}
    dtype = settings.model_dtype(config)
    files["train.py"] = render_train_script(
        model=_model_location(request.model_id), plan_id=plan_id, rank=rank, label=config.label(), seq_len=config.seq_len,
        dtype=dtype, dtype_why=_dtype_why(config, dtype), attention=config.attention.hf_name,
        masked_lm=spec.is_encoder, dataset=dataset, seq2seq=spec.is_encoder_decoder, **settings.script_recipe(config),
    )
    files["training_args.json"] = _json(settings.training_arguments(config, on_cpu=on_cpu))
    optional = {
        **settings.sharding_files(config, spec=spec, on_cpu=on_cpu),  # the sharding scheme's (ds_config.json)
        "lora_config.json": settings.lora_config(config, spec=spec),
        "bnb_config.json": settings.bnb_config(config),
    }
    files.update({name: _json(data) for name, data in optional.items() if data is not None})
    files["accelerate_config.yaml"] = settings.to_yaml(settings.accelerate_config(config, on_cpu=on_cpu))
    names = [n for n in FILE_NAMES if n in files or n == "PLAN.md"]
    files["PLAN.md"] = render_plan_md(
        candidate=candidate, spec=spec, request=request, plan_id=plan_id, rank=rank, usable_bytes=usable_bytes,
        measurements=measurements, status=status, files=names,
    )
    return {name: files[name] for name in names}


def _model_location(model_id: str) -> str:
    """What ``from_pretrained`` loads: a catalog/HF id as is, the folder of a local config.json."""
    if model_id.endswith(".json"):
        return str(PurePath(model_id).parent)
    return model_id


def _dtype_why(config: "TrainConfig", dtype: str) -> str:
    """The comment next to train.py's MODEL_DTYPE."""
    from planner.config import Method, Precision

    if config.method is Method.QLORA:
        return "the compute dtype; the 4-bit weights come from bnb_config.json"
    if dtype != "float32":
        return f"pure {config.precision}: weights, gradients and optimizer states in {dtype}"
    cast = config.sharding.spec.cast_words("bf16" if config.precision.needs_bf16 else "fp16")
    if config.precision.is_mixed and cast is not None:
        return cast[1]
    if config.precision is Precision.FP8:
        return "fp32 weights; bf16 autocast and fp8 linears by accelerate's torchao backend (accelerate_config.yaml)"
    if config.precision.is_mixed:
        return "fp32 weights; 16-bit compute by autocast (bf16/fp16 in training_args.json)"
    return "fp32 weights and compute"


def pick_candidate(plan: "StoredPlan", *, rank: int) -> "StoredCandidate":
    """The candidate with this rank (1 = best); a ``planner measure`` record's only candidate."""
    ranked = {c.candidate.rank: c for c in plan.candidates if c.candidate.rank is not None}
    if rank in ranked:
        return ranked[rank]
    if not ranked and len(plan.candidates) == 1 and rank == 1:
        return plan.candidates[0]
    if not ranked:
        raise PlannerError(f"plan {plan.id[:8]} has no configuration that fits: nothing to emit; plan again with other limits")
    raise PlannerError(f"plan {plan.id[:8]} has no rank {rank}: use --rank {min(ranked)} to {max(ranked)}")


def resolve_plan_model(plan: "StoredPlan") -> "ModelSpec":
    """The plan's model, resolved again and checked to be the one planned for."""
    from planner.catalog import fingerprint, resolve_model

    spec = resolve_model(plan.request.model_id)
    if plan.request.model_fingerprint and fingerprint(spec) != plan.request.model_fingerprint:
        raise PlannerError(
            f"the config of {plan.request.model_id} changed since plan {plan.id[:8]} was made: "
            "plan again with 'planner suggest' and emit that plan"
        )
    return spec


def emitted_files(*, plan: "StoredPlan", rank: int = 1, dataset: str | None = None,
                  target: str = "hf") -> tuple[dict[str, str], str]:
    """(file name -> text, the launch line) of the plan's candidate ``rank`` for ``target``."""
    from planner.emit.trainers import trainer_files
    from planner.gpus import get_gpu

    stored = pick_candidate(plan, rank=rank)
    spec = resolve_plan_model(plan)
    if target != "hf":
        on_cpu = get_gpu(plan.request.gpu, memory_bytes=plan.request.gpu_memory_bytes).is_cpu
        return trainer_files(target, config=stored.candidate.config, spec=spec, model=_model_location(plan.request.model_id),
                             dataset=dataset, on_cpu=on_cpu)
    files = plan_files(
        candidate=stored.candidate, spec=spec, request=plan.request, plan_id=plan.id, rank=rank, dataset=dataset,
        measurements=[m.measurement for m in stored.measurements], status=str(plan.status),
        usable_bytes=plan.usable_bytes,
    )
    return files, HF_LAUNCH.format(data=dataset or "DATA")


def check_directory(directory: Path | str, *, force: bool) -> None:
    """Refuse a path that is a file, or a directory that holds files (unless ``force``): callers
    check before they plan or store anything, ``write_plan_files`` again before it writes."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputExistsError(f"{directory} is a file, not a directory: give a new or empty directory")
    # a new directory is made with its parents: the nearest one that exists must be a directory
    # (under a file, mkdir raised NotADirectoryError after the plan was made and stored)
    existing = next((p for p in directory.absolute().parents if p.exists()), None)
    if not directory.exists() and existing is not None and not existing.is_dir():
        raise OutputExistsError(f"{directory} cannot be made: {existing} is a file, not a directory; "
                                "give a new or empty directory")
    if force or not directory.exists():
        return
    present = sorted(p.name for p in directory.iterdir())
    if present:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise OutputExistsError(
            f"{directory} already holds files ({shown}): give a new or empty directory, or --force to overwrite"
        )


def write_plan_files(
    *, plan: "StoredPlan", rank: int = 1, directory: Path, force: bool = False, dataset: str | None = None,
    target: str = "hf",
) -> list[Path]:
    """Write the files of the plan's candidate ``rank`` into ``directory`` (created if missing):
    train.py and its files (``target`` "hf"), or the config of the trainer ``target`` names
    (``planner.emit.trainers``).

    A directory that already holds files is refused unless ``force``, which overwrites the
    emitted names and removes emitted names this plan does not use (a stale lora_config.json
    would be read by train.py); other files are left alone. Returns the paths written."""
    files, _launch = emitted_files(plan=plan, rank=rank, dataset=dataset, target=target)
    return write_files(files, directory=directory, force=force)


def write_files(files: dict[str, str], *, directory: Path | str, force: bool = False) -> list[Path]:
    """``write_plan_files``' writing: refused into a directory with files unless ``force``. All or
    nothing: every file is written beside its name first and renamed once all are; a directory
    that cannot be made or written (no permission, a read-only or virtual file system, a full
    disk) is one line, with what was begun removed and what was there (``force``) untouched."""
    check_directory(directory, force=force)
    directory = Path(directory)
    made = [p for p in (directory, *directory.absolute().parents) if not p.exists()]
    pending: list[tuple[Path, Path]] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = directory / name
            part = partial_of(path)
            pending.append((part, path))
            part.write_text(text, encoding="utf-8")
        for part, path in pending:
            part.replace(path)
        for stale in set(ALL_FILE_NAMES) - set(files):
            (directory / stale).unlink(missing_ok=True)
    except OSError as exc:
        discard(part for part, _path in pending)
        for folder in made:  # the directories this call made, deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise OutputWriteError(f"{directory}: cannot write the plan's files there ({exc.strerror or exc}): "
                               "give a directory you can write to") from None
    return [path for _part, path in pending]


__all__ = ["ALL_FILE_NAMES", "FILE_NAMES", "HF_LAUNCH", "OutputExistsError", "OutputWriteError", "check_directory", "emitted_files", "pick_candidate",
           "plan_files", "resolve_plan_model", "write_files", "write_plan_files"]
