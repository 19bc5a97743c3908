"""A planning request: what ``planner suggest`` (and ``POST /v1/plans``) asks the search.

``SuggestRequest`` holds the user's request as it was given (model name, GPU name, sizes in
bytes); ``make_plan`` resolves and validates it, searches and returns the ranked result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.limits import MAX_GPUS_PER_NODE, check_gpu_count
from planner.request import recipe_of, with_recipe_fields

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.results import PlanResult

#: suggest's --method / --precision accept these besides the enum values
AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
@with_recipe_fields
class SuggestRequest:
    """What to plan for. Names are resolved and values validated by ``make_plan``."""

    model: str
    """Catalog id, path to a config.json or model folder, or an HF id in the local cache."""
    gpu: str
    """GPU name from the catalog (``planner gpus``) or ``cpu``."""
    target_batch: int
    """Global batch in sequences: micro-batch x accumulation x GPUs."""
    seq_len: int | None = None
    """Tokens per sequence; None: min(2048, the model's maximum)."""
    gpus: int = 1
    """Data-parallel devices (on one node)."""
    gpu_mem_bytes: int | None = None
    """Override of the device memory (on ``cpu``: the limit verification runs are held to)."""
    method: str = AUTO
    """auto|full|lora|qlora."""
    precision: str = AUTO
    """auto|fp32|fp16-mixed|bf16-mixed|fp16|bf16."""
    allow_offload: bool = True
    """Consider DeepSpeed CPU offload."""
    cpu_mem_bytes: int | None = None
    """Host RAM of the node for offload; None: the standard machine of ``gpus`` x ``gpu`` from the
    catalog (``planner.gpus.standard_node``), this machine's RAM when the planning machine is the
    node (``gpu`` cpu, or ``local_node``), else unknown and offload plans are refused."""
    top_k: int = 5
    """Plans to keep."""
    prefer: str = "fidelity"
    """Ranking policy: fidelity (the most faithful method first, then speed) or speed."""
    local_node: bool = False
    """The GPU was found on this machine (--gpu auto): the planning machine is the node, and its
    RAM is the default host RAM for offload."""
    schemes: tuple[str, ...] | None = None
    """The sharding schemes searched (None: every one; ``planner check``: those its files can say)."""
    stated: tuple[str, ...] | None = None
    """The recipe settings the user gave explicitly (the command line's flags, the body's keys): with
    ``transformers``, they keep their values over the version's (``planner.estimation.versioned``; None:
    those set on)."""
    # then the recipe settings (``planner.request.RECIPE``), each with its plain type and
    # default (``transformers`` among them: the release whose knobs the recipe takes)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """``make_plan``'s answer: the ranked result and what it was resolved against."""

    result: "PlanResult"
    spec: "ModelSpec"
    device: "GPUSpec"
    host_bytes: int
    """Host RAM of the node the search allowed offload to use (0: not known)."""
    host_source: str = ""
    """Where ``host_bytes`` comes from ("" when not known: offload plans were refused)."""
    seq_defaulted: bool
    """True when the sequence length was not given and the default was used."""


def warm() -> None:
    """Import what ``make_plan`` runs on and read the model catalog, once. A server calls it at
    startup so that its first request is not charged for them: the per-request CPU budget
    (``planner.service.budget``) measured 0.11 s of the first gpt2 request's 0.20 s as these imports and the
    catalog read, and a request stopped at its budget while importing leaves them to the next request.
    ``tests/service/test_service_cost.py`` checks that planning after it imports no planner module."""
    from planner import advice, estimation, gpus, host, ranking, search  # noqa: F401 - imported for their cost
    from planner.calibration import lookup, values  # noqa: F401
    from planner.catalog import catalog_ids

    catalog_ids()


def make_plan(request: SuggestRequest, *, spec: "ModelSpec | None" = None,
              calibration: "Calibration | None" = None, alternative: bool = True, first_only: bool = False) -> Planned:
    """Resolve, validate and search. ``spec`` replaces resolving ``request.model`` (a config sent
    inline over HTTP); ``calibration``: the device's active one (``planner calibrate``), which the
    plans use and name in their assumptions. Raises ``PlannerError``s for bad input and
    ``NothingFitsError`` (with the closest tries) when nothing fits. ``alternative``: rank by the
    other policy too; ``first_only``: the caller reads the #1 plan alone (``ranking.suggest``)."""
    from planner.calibration import apply_calibration
    from planner.catalog import fingerprint
    from planner.config import Method, Precision
    from planner.errors import InvalidConfigError
    from planner.estimation import check_recipe, default_seq_len, model_as_run, resolve, versioned
    from planner.gpus import check_precision, get_gpu
    from planner.host import node_host_ram
    from planner.limits import check_model_id, check_search_cost
    from planner.ranking import suggest
    from planner.search import SearchSpace

    if spec is None:
        spec, device = resolve(model=request.model, gpu=request.gpu, gpu_mem_bytes=request.gpu_mem_bytes)
    else:
        device = get_gpu(request.gpu, memory_bytes=request.gpu_mem_bytes)
    device = apply_calibration(device, calibration)
    # the knobs of the transformers release named, for this model, before it is built as run
    recipe = versioned(spec, {**recipe_of(request), "transformers": request.transformers}, stated=request.stated)
    spec = model_as_run(spec, recipe)
    if request.method != AUTO and request.method not in {m.value for m in Method}:
        raise InvalidConfigError(f"--method must be one of auto|{'|'.join(m.value for m in Method)}, got {request.method!r}")
    if request.precision != AUTO and request.precision not in {p.value for p in Precision}:
        raise InvalidConfigError(
            f"--precision must be one of auto|{'|'.join(p.value for p in Precision)}, got {request.precision!r}"
        )
    check_gpu_count(request.gpus)
    methods = tuple(Method) if request.method == AUTO else (Method(request.method),)
    precisions = None if request.precision == AUTO else (Precision(request.precision),)
    if precisions:
        check_precision(device, precisions[0])
    host, source = node_host_ram(cpu_mem_bytes=request.cpu_mem_bytes, local_node=request.local_node, gpus=request.gpus,
                                 device=device)
    space = SearchSpace(methods=methods, precisions=precisions, allow_offload=request.allow_offload, cpu_mem_bytes=host,
                        host_ram_source=source, prefer=request.prefer, schemes=request.schemes, **recipe)
    seq = default_seq_len(spec) if request.seq_len is None else request.seq_len
    check_recipe(spec, recipe, seq_len=seq)  # estimate's check (a fused CE needs a causal LM's head)
    check_model_id(spec.id)  # before anything is printed: the store would refuse it after
    check_search_cost(spec, methods=space.methods, lora_ranks=space.lora_ranks, top_k=request.top_k)
    result = suggest(model=spec, gpu=device, target_batch=request.target_batch, seq_len=seq, gpus=request.gpus,
                     space=space, top_k=request.top_k, model_fingerprint=fingerprint(spec),
                     alternative=alternative, first_only=first_only)
    return Planned(result=result, spec=spec, device=device, host_bytes=host, host_source=source,
                   seq_defaulted=request.seq_len is None)




__all__ = ["AUTO", "MAX_GPUS_PER_NODE", "Planned", "SuggestRequest", "check_gpu_count", "make_plan"]
