"""One fully specified configuration: resolve the model and device, validate, predict.

The library behind ``planner estimate`` and ``planner measure`` (and ``POST /v1/estimate``):
callers parse their own input and print; everything that decides lives here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from planner import request as _request

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.results import MemoryEstimate, ThroughputEstimate

#: the sequence length used when none is given (capped at the model's maximum)
DEFAULT_SEQ_LEN = 2048

#: the TrainConfig fields that estimate and measure take as options of the same name (the request's
#: declaration, ``planner.request``)
CONFIG_OPTIONS = _request.CONFIG_OPTIONS


def resolve(*, model: str, gpu: str, gpu_mem_bytes: int | None = None,
            calibration: "Calibration | None" = None) -> "tuple[ModelSpec, GPUSpec]":
    """The model (catalog id, config path or HF cache id) and the device (catalog name), with the
    device's ``calibration`` (``planner calibrate``) applied when one is given."""
    from planner.calibration import apply_calibration
    from planner.catalog import resolve_model
    from planner.gpus import get_gpu

    spec = resolve_model(model)
    return spec, apply_calibration(get_gpu(gpu, memory_bytes=gpu_mem_bytes), calibration)


def model_as_run(spec: "ModelSpec", options: Mapping[str, Any]) -> "ModelSpec":
    """The model as the request's transformers builds it: with ``experts_loop``, transformers 4's per-expert
    MoE modules (``planner.catalog.modern.per_expert_layout``; refused for a model type it does not build),
    else ``spec`` (transformers 5's fused expert stacks)."""
    if not options.get("experts_loop"):
        return spec
    from planner.catalog.modern import per_expert_layout

    return per_expert_layout(spec)


def versioned(spec: "ModelSpec", options: Mapping[str, Any], *,
              stated: "Iterable[str] | None" = None) -> dict[str, Any]:
    """``options`` less ``transformers``, with the knobs that version sets for ``spec``
    (``planner.transformers_versions.knobs_for``) where they were not stated: a knob in ``stated`` (the command
    line's flags given, the body's keys sent) or set on keeps its value, so a knob given explicitly wins over the
    version's (None, the Python API: those set on). With a loss of the recipe's own (``planner.request.own_loss``)
    the version's loss is not run: its loss knobs are left as given. Without ``transformers``, ``options``
    as they are (transformers 5's)."""
    options = dict(options)
    version = options.pop("transformers", None)
    if version is None:
        return options
    from planner.transformers_versions import KNOBS as knobs_of, knobs_for

    kept = set(stated or ()) | {name for name in knobs_of if options.get(name)}
    knobs = knobs_for(version, spec.model_type, is_moe=spec.is_moe, causal_lm=not (spec.is_encoder or spec.is_encoder_decoder),
                      encoder_decoder=spec.is_encoder_decoder, model_id=spec.id, experts_stated="experts_loop" in kept)
    if _request.own_loss(options):
        kept |= {"loss_shift", "loss_returns_head"}
    for name, value in knobs.items():
        if name not in kept:
            options[name] = value
    return options


def check_runs_installed(options: Mapping[str, Any], *, command: str,
                         fix: str = "drop --transformers (planner estimate and suggest plan that version)") -> None:
    """What runs the installed transformers (5.x: ``planner measure``'s worker, ``--verify``'s runs, the files
    ``--emit`` writes) refuses a ``transformers`` older than 5, in one line, before anything is planned."""
    version = options.get("transformers")
    if version is None:
        return
    from planner.transformers_versions import parse

    if parse(version)[0] < 5:
        from planner.errors import UnsupportedError

        raise UnsupportedError(f"{command} run the installed transformers 5, not --transformers {version}: {fix}")


def default_seq_len(spec: "ModelSpec") -> int:
    return min(DEFAULT_SEQ_LEN, spec.max_seq_len)


def check_recipe(spec: "ModelSpec", recipe: Mapping[str, Any], *, seq_len: int | None = None) -> None:
    """The recipe settings this model cannot take (estimate and suggest alike:
    ``planner.request.check_for_model``; ``seq_len``: the training length, the eval prompt's by
    default, held with the eval's generated tokens to the context the recipe's RoPE scaling gives),
    and an architecture whose features the memory model has no terms for yet (``check_plannable``)."""
    from planner.catalog import check_plannable
    from planner.config import context_limit

    check_plannable(spec)
    _request.check_for_model(model_id=spec.id, is_encoder=spec.is_encoder, values=recipe,
                             is_encoder_decoder=spec.is_encoder_decoder, max_seq_len=context_limit(spec, recipe),
                             seq_len=seq_len)


def build_config(spec: "ModelSpec", gpu: "GPUSpec", *, seq_len: int | None, **options: Any) -> "TrainConfig":
    """A validated TrainConfig for this model and device (one-line errors on bad input)."""
    from planner.config import TrainConfig
    from planner.errors import InvalidConfigError
    from planner.gpus import check_attention, check_precision
    from planner.limits import check_estimate_cost, check_gpu_count, check_model_id
    from planner.memory import lora_targets

    # the GPUs of one node, as suggest bounds them (the interconnect and host RAM are one node's)
    check_gpu_count(options.get("gpus", 1))
    check_model_id(spec.id)  # printable, as suggest's (its output and a measure's record show it)
    check_estimate_cost(spec)  # before any work: the bounds of planner.limits
    seq = default_seq_len(spec) if seq_len is None else seq_len
    _sharding_option(options)
    from planner.config import check_context

    check_context(spec, seq, options)
    if options.get("precision") is None:
        from planner.defaults import default_precision

        options["precision"] = default_precision(options.get("method", "full"), gpu)
    if options.get("lora_targets") is None and spec.lora_refused and str(options.get("method", "full")) != "full":
        # the default every-linear adapter, named, where all-linear fails on the model type (ModelSpec.lora_refused)
        options["lora_targets"] = spec.peft_linear_names
    config = TrainConfig(seq_len=seq, **options)
    check_recipe(spec, _request.recipe_of(config), seq_len=config.seq_len)
    check_precision(gpu, config.precision)
    check_attention(gpu, config.attention)
    targets = lora_targets(spec, config)  # unknown module names fail here, with the names that exist
    if targets and config.lora_r > (widest := max(min(lin.in_features, lin.out_features) for lin in targets)):
        raise InvalidConfigError(
            f"--lora-r {config.lora_r} is more than the adapted layers' width ({widest}): a rank above "
            f"min(in, out) adds parameters but no capacity; use at most {widest}, e.g. 16"
        )
    return config


def _sharding_option(options: dict[str, Any]) -> None:
    """``sharding`` (a scheme's name) or the older ``zero`` stage, not both: the one given, in
    ``options`` as ``TrainConfig`` takes it (``zero=None`` when the scheme is named)."""
    from planner.errors import InvalidConfigError

    scheme = options.pop("sharding", None)
    if scheme is None:
        return
    if not isinstance(scheme, str):  # a Sharding value (planner check's): TrainConfig reconciles it with zero
        options["sharding"] = scheme
        return
    if options.get("zero") not in (None, 0):
        raise InvalidConfigError(f"--sharding {scheme} and --zero {options['zero']} both name the sharding: give one "
                                 f"(--sharding zero{options['zero']} is --zero {options['zero']})")
    options["zero"] = None
    options["sharding"] = scheme


def estimate_dict(spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig", estimate: "MemoryEstimate",
                  throughput: "ThroughputEstimate", usable: int) -> dict[str, Any]:
    """The JSON form of one estimate (``planner estimate --json``), with the plan's 90% interval
    (``memory.peak_interval_bytes``) and its probability of running out of memory
    (``oom_probability``, and ``near_edge`` past NEAR_EDGE_PROBABILITY) as suggest gives them
    (``planner.tradeoffs``)."""
    from planner.memory import trainable_params
    from planner.tradeoffs import memory_interval, near_edge, oom_risk

    if estimate.oom_probability is None:
        estimate = estimate.with_uncertainty(interval=memory_interval(config, estimate),
                                             oom_probability=oom_risk(config, estimate, capacity=gpu.memory_bytes))
    return {
        "model": {"id": spec.id, "params": spec.params_total, "active_params": spec.params_active,
                  "trainable_params": trainable_params(spec, config),
                  # a release variant's base architecture, a wrapper's language model: only when so
                  **({"architecture_of": spec.alias_of} if spec.alias_of else {}),
                  **({"language_model_of": spec.wrapper_type} if spec.wrapper_type else {})},
        "config": {"model": spec.id, "gpu": gpu.name, "gpu_mem": gpu.memory_bytes, **config.to_dict()},
        "memory": estimate.to_dict(),
        "allocator": {"peak_reserved_bytes": estimate.peak_reserved_bytes, "fragmentation_bytes": estimate.fragmentation_bytes,
                      "alloc_conf": config.alloc_conf, "replayed": gpu.kernels.caching_allocator},
        "device": {"name": gpu.name, "capacity_bytes": gpu.memory_bytes, "usable_bytes": usable},
        "fits": estimate.process_total_bytes <= usable,
        "oom_probability": estimate.oom_probability,
        "near_edge": near_edge(config, estimate, capacity=gpu.memory_bytes),
        "throughput": throughput.to_dict(),
    }


def estimate_configuration(*, spec: "ModelSpec", gpu: "GPUSpec", seq_len: int | None = None,
                           stated: "Iterable[str] | None" = None, **options: Any) -> "tuple[dict[str, Any], MemoryEstimate]":
    """Memory and speed of one configuration: (the ``--json`` dict, the memory estimate).

    ``options`` are TrainConfig fields (see ``CONFIG_OPTIONS``) and ``transformers``, the release whose knobs
    the configuration takes (``versioned``; ``stated``: the knobs given explicitly); ``precision=None`` takes
    the device's mixed precision."""
    from planner.memory import estimate_memory
    from planner.search import safety_margin
    from planner.throughput import estimate_throughput

    options = versioned(spec, options, stated=stated)
    spec = model_as_run(spec, options)
    config = build_config(spec, gpu, seq_len=seq_len, **options)
    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    memory = estimate_memory(model=spec, config=config, gpu=gpu, budget=usable)  # (fits as suggest's plans do)
    throughput = estimate_throughput(model=spec, config=config, gpu=gpu, paged_host=memory.paged_host_bytes)
    return estimate_dict(spec, gpu, config, memory, throughput, usable), memory


def step_curves(*, spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig"):
    """The predicted step as curves (``planner.plot.StepCurves``): live bytes by category and,
    where there is a caching allocator, its replayed reserve."""
    from planner.memory.estimate import device_timeline, replay_timeline
    from planner.plot import step_curves as curves_of

    # the timeline the estimate replays, cuBLAS workspaces included, so the curves peak where it does
    timeline = device_timeline(model=spec, config=config, gpu=gpu)
    reserved = None
    if gpu.kernels.caching_allocator:
        reserved = []
        replay_timeline(timeline, config, gpu, trace=reserved)
    return curves_of(timeline, reserved=reserved)


def draw_step(*, spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig", estimate: "MemoryEstimate", path: str,
              measured: list | None = None, measured_phases: list | None = None) -> str:
    """Write the picture of one step to ``path`` (.svg, .png, .html); ``measured``: a measured
    curve, [seconds, bytes] pairs, drawn over the predicted one (aligned on ``measured_phases``,
    [seconds, phase name]). Returns the path written."""
    from planner.plot import timeline_picture, write_picture
    from planner.search import safety_margin

    curves = step_curves(spec=spec, gpu=gpu, config=config)
    title = f"{spec.id} on {gpu.display_name}: {config.label()}"
    fig, _ = timeline_picture(curves, estimate=estimate, capacity=gpu.memory_bytes,
                              usable=gpu.memory_bytes - safety_margin(gpu.memory_bytes), title=title, measured=measured,
                              measured_phases=measured_phases)
    return str(write_picture(fig, path))


__all__ = ["CONFIG_OPTIONS", "check_runs_installed", "versioned", "draw_step", "step_curves", "DEFAULT_SEQ_LEN", "build_config", "default_seq_len", "estimate_configuration",
           "estimate_dict", "resolve"]
