"""Request bodies -> the library calls the CLI makes. Nothing here decides a plan.

The one rule of its own: over HTTP a model is a catalog id or a config.json sent inline, never a
path or an id looked up on the server's disk (``resolve_model`` would read both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.errors import InvalidConfigError, UnknownModelError

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.modelspec import ModelSpec
    from planner.planning import SuggestRequest
    from planner.service.check_body import CheckBody
    from planner.service.schemas import CompareBody, EstimateBody, ModelChoice, PlanBody, Size
    from planner.store import StoredPlan

#: ``ModelSpec.source`` of a config.json sent in a request
INLINE_SOURCE = "inline"


def size_bytes(value: "Size", *, field: str) -> int | None:
    """A size field as bytes, with the CLI's rules (unit required in text, > 0, <= 1 PiB)."""
    from planner.units import size_of

    return size_of(value, option=f"--{field.replace('_', '-')}")


def _looks_like_a_path(model: str) -> bool:
    """Written as a path: ``./gpt2`` would otherwise be read as the org ``.`` of the catalog's
    ``gpt2`` (``<org>/<name>`` finds an org-less id), while its sender meant a folder."""
    name = model.strip()
    return name.startswith((".", "/", "~", "\\")) or name.lower().endswith(".json") or "\\" in name \
        or any(part in (".", "..") for part in name.split("/"))


def require_catalog_id(model: str) -> None:
    """``UnknownModelError`` unless ``model`` is a catalog id (so nothing on disk is read), and
    not written as a path."""
    from planner.catalog import catalog_source

    try:
        if _looks_like_a_path(model):
            raise UnknownModelError(model)
        catalog_source(model)
    except UnknownModelError:
        raise UnknownModelError(
            f"--model {model!r} is not a catalog id (GET /v1/models lists them): over HTTP, send the model's "
            "config.json inline as \"config\"; the server never reads paths or its own caches"
        ) from None


def inline_spec(body: "ModelChoice") -> "ModelSpec | None":
    """The spec of an inline config.json; None (after the catalog check) for a catalog id."""
    from planner.catalog import spec_from_config

    if body.config is None:
        require_catalog_id(body.model)
        return None
    return spec_from_config(body.config, model_id=body.model, source=INLINE_SOURCE)


def version_of(body: Any) -> dict[str, Any]:
    """The body's ``transformers`` release with the keys sent (``stated``: the knobs sent win over the
    version's, ``planner.estimation.versioned``), for a ``SuggestRequest`` or ``estimate_configuration``."""
    if body.transformers is None:
        return {}
    return {"transformers": body.transformers, "stated": tuple(sorted(body.model_fields_set))}


def suggest_request(body: "PlanBody") -> "SuggestRequest":
    from planner.planning import SuggestRequest
    from planner.request import recipe_of

    return SuggestRequest(
        model=body.model, gpu=body.gpu, target_batch=body.target_batch, seq_len=body.seq_len, gpus=body.gpus,
        gpu_mem_bytes=size_bytes(body.gpu_mem, field="gpu_mem"), method=body.method, precision=body.precision,
        allow_offload=body.allow_offload, cpu_mem_bytes=size_bytes(body.cpu_mem, field="cpu_mem"), top_k=body.top_k,
        prefer=body.prefer, **recipe_of(body), **version_of(body),
    )


def compare(body: "CompareBody", *, calibrations: dict[str, Any]) -> dict[str, Any]:
    """``planner suggest --gpu any --json``: the request on every GPU type and count, priced by the
    shipped table or the prices sent (never a file of the server's)."""
    from planner.planning import SuggestRequest
    from planner.pricing import PriceTable, load_prices, price_rows
    from planner.rent import compare_gpus, parse_tokens, workload
    from planner.request import recipe_of

    spec = inline_spec(body)
    table = (load_prices() if body.prices is None
             else PriceTable(prices=price_rows(body.prices, where="prices"), origin="the prices sent"))

    def count(value: Any, option: str) -> int | None:
        return None if value is None else parse_tokens(str(value), option=option)

    job = workload(tokens=count(body.tokens, "tokens"), epochs=body.epochs,
                   epoch_tokens=count(body.dataset_tokens, "dataset_tokens"), epoch_source="dataset_tokens")
    request = SuggestRequest(model=body.model, gpu="any", target_batch=body.target_batch, seq_len=body.seq_len,
                             method=body.method, precision=body.precision, allow_offload=body.allow_offload,
                             prefer=body.prefer, top_k=1, **recipe_of(body), **version_of(body))
    comparison = compare_gpus(request, workload=job, prices=table, gpus_max=body.gpus_max, spec=spec,
                              gpu_names=body.gpu_types, calibration_of=calibrations.get)
    return comparison.to_dict()


def estimate(body: "EstimateBody", *, calibration: "Calibration | None" = None) -> dict[str, Any]:
    """``planner estimate --json`` of one configuration, with the device's active calibration."""
    from planner.calibration import apply_calibration
    from planner.estimation import CONFIG_OPTIONS, estimate_configuration, resolve
    from planner.gpus import get_gpu

    gpu_mem = size_bytes(body.gpu_mem, field="gpu_mem")
    spec = inline_spec(body)
    if spec is None:
        spec, device = resolve(model=body.model, gpu=body.gpu, gpu_mem_bytes=gpu_mem, calibration=calibration)
    else:
        device = apply_calibration(get_gpu(body.gpu, memory_bytes=gpu_mem), calibration)
    options = {name: getattr(body, name) for name in CONFIG_OPTIONS}
    data, _memory = estimate_configuration(spec=spec, gpu=device, seq_len=body.seq_len, **options, **version_of(body))
    return data


def check(body: "CheckBody", *, calibration: "Calibration | None" = None) -> dict[str, Any]:
    """``planner check --json`` of files sent as text (nothing read from the server's disk): the
    model is a catalog id or the config sent inline, as for a plan."""
    from planner.check import check_reading, files, read_texts
    from planner.gpus import get_gpu

    # what is wrong with the request without the trainers' libraries first: their first import
    # takes tens of seconds on a loaded 2-core machine, and a bad GPU or model needs none of it
    sent = [files.parse(name, text) for name, text in body.texts().items()]
    get_gpu(body.gpu, memory_bytes=size_bytes(body.gpu_mem, field="gpu_mem"))
    # the model keys of the HF/TRL/LLaMA-Factory arguments and of axolotl (torchtune's is a folder on disk)
    named = next((str(f.data[k]) for f in sent for k in ("model_name_or_path", "base_model") if f.data.get(k)), None)
    name = body.model or named
    if body.config is None:
        if name is None:
            raise InvalidConfigError("no file names the model: send \"model\" (a catalog id), or model_name_or_path "
                                     "(axolotl: base_model) in the training config")
        require_catalog_id(name)
    _import_trainers()
    reading = read_texts(body.texts(), trainer=body.trainer)
    spec = spec_from_config_body(body.config, name) if body.config is not None else None
    result = check_reading(reading, gpu=body.gpu, model=name, gpus=body.gpus, seq_len=body.seq_len, spec=spec,
                           gpu_mem_bytes=size_bytes(body.gpu_mem, field="gpu_mem"),
                           cpu_mem_bytes=size_bytes(body.cpu_mem, field="cpu_mem"), calibration=calibration)
    return result.to_dict()


def _import_trainers() -> None:
    """The trainers' libraries (transformers, TRL, peft, accelerate: torch with them), imported in
    a thread of their own and waited for: the first check of a server process pays their import
    (over 10 s of CPU on the 2-core CI machine) once, and the request's CPU budget
    (``planner.service.budget``, the answering thread's own clock) bounds the request's work, not
    an import Python then caches for every later request."""
    import threading

    from planner.check.schemas import load_all

    loader = threading.Thread(target=load_all, name="planner-check-imports", daemon=True)
    loader.start()
    loader.join()


def spec_from_config_body(config: dict[str, Any], name: str | None) -> "ModelSpec":
    from planner.catalog import spec_from_config

    return spec_from_config(config, model_id=name or "inline-model", source=INLINE_SOURCE)


#: points of a timeline the web page draws: the step's events thinned to this many (each kept point
#: the largest allocated of its stretch, so the peak is never thinned away)
TIMELINE_POINTS = 400


def _require_catalog_plan(plan: "StoredPlan") -> None:
    """A plan whose model the server may resolve again: a catalog id only (over HTTP nothing of the
    server's disk is read); a plan of a config sent inline cannot be drawn or emitted here."""
    try:
        require_catalog_id(plan.request.model_id)
    except UnknownModelError:
        raise InvalidConfigError(
            f"plan {plan.id[:8]} is of a config sent inline ({plan.request.model_id!r}); the server keeps no "
            "config, so its files and timeline come from 'planner emit' and 'planner estimate --timeline' where "
            "the config is"
        ) from None


def plan_files_zip(plan: "StoredPlan", *, rank: int) -> bytes:
    """``planner emit PLAN_ID DIR --rank RANK``'s files, as one zip archive."""
    import io
    import tempfile
    import zipfile
    from pathlib import Path

    from planner.emit import write_plan_files

    _require_catalog_plan(plan)  # (write_plan_files resolves the model itself)
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="planner-emit-") as folder:
        written = write_plan_files(plan=plan, rank=rank, directory=Path(folder) / "plan")
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for path in written:
                archive.write(path, arcname=path.name)
    return buffer.getvalue()


def plan_timeline(plan: "StoredPlan", *, rank: int) -> dict[str, Any]:
    """The predicted step of the plan's candidate ``rank`` as curves (``planner estimate
    --timeline``'s picture, as numbers): live bytes by category and the allocator's reserve at
    each point, the moments, the peak, the device's capacity and usable memory."""
    from planner.emit import pick_candidate, resolve_plan_model
    from planner.estimation import step_curves
    from planner.gpus import get_gpu

    candidate = pick_candidate(plan, rank=rank).candidate
    _require_catalog_plan(plan)
    spec = resolve_plan_model(plan)
    gpu = get_gpu(plan.request.gpu, memory_bytes=plan.request.gpu_memory_bytes or None)
    curves = step_curves(spec=spec, gpu=gpu, config=candidate.config)
    keep = _thinned(curves.allocated, TIMELINE_POINTS)
    return {
        "plan_id": plan.id, "rank": rank, "label": candidate.config.label(),
        "x": [curves.x[i] for i in keep],
        "stacks": {name: [values[i] for i in keep] for name, values in curves.stacks.items()},
        "allocated": [curves.allocated[i] for i in keep],
        "reserved": [curves.reserved[i] for i in keep] if curves.reserved is not None else None,
        "marks": curves.marks, "peak_x": curves.x[curves.peak_index],
        "peak_bytes": candidate.memory.peak_allocated_bytes, "peak_phase": candidate.memory.peak_phase,
        "capacity_bytes": gpu.memory_bytes, "usable_bytes": plan.usable_bytes,
    }


def _thinned(values: list[int], points: int) -> list[int]:
    """Indices of at most about ``points`` values: the largest of each stretch, first and last kept."""
    n = len(values)
    if n <= points:
        return list(range(n))
    per = -(-n // points)
    keep = {0, n - 1}
    for start in range(0, n, per):
        stretch = range(start, min(start + per, n))
        keep.add(max(stretch, key=values.__getitem__))
    return sorted(keep)


def from_store(plan: "StoredPlan") -> dict[str, Any]:
    """``planner suggest --json`` of a request answered from the store."""
    from planner.answers import from_store_dict

    return from_store_dict(plan)


def check_verifiable(body: "PlanBody") -> None:
    """A Ray job re-resolves the model by name on the cluster: an inline config cannot travel."""
    if body.config is not None:
        raise InvalidConfigError(
            "--verify needs a catalog model: the Ray job resolves the model by its id and cannot carry an inline "
            "config.json; plan it without \"verify\", or verify it with 'planner suggest --verify' where the config is"
        )


__all__ = ["INLINE_SOURCE", "TIMELINE_POINTS", "check", "check_verifiable", "compare", "estimate", "from_store",
           "inline_spec", "plan_files_zip", "plan_timeline",
           "require_catalog_id", "size_bytes", "suggest_request"]
