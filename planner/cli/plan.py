"""``planner estimate`` and ``planner measure``: parse, call the library, print.

Also the option definitions and helpers that ``planner suggest`` (``planner.cli.suggest_cmd``) shares."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Optional

import typer

from planner.request import ESTIMATE, FIELDS, RequestField, help_text


def option(field: RequestField) -> Any:
    """The typer option of a declared request field: its default, flag and help."""
    return typer.Option(field.default, field.flag, *([field.short] if field.short else []), help=help_text(field))


def _annotation(field: RequestField) -> Any:
    return Optional[field.type] if field.optional else field.type


# Options shared by estimate and measure (one definition, two commands); the request's fields are
# made from their declaration (``planner.request``) by ``request_options``.
_MODEL = typer.Option(..., "--model", "-m", help="Catalog id, path to a config.json/model dir, or an HF id in the local cache.")
_GPU = typer.Option(..., "--gpu", "-g", help="GPU name from 'planner gpus' (cpu: the CPU measurement profile; auto: this machine's GPU, through NVML).")
_GPUS = option(FIELDS["gpus"])
_GPU_MEM = typer.Option(None, "--gpu-mem", help="Override the device memory, e.g. 20GiB.")
_JSON = typer.Option(False, "--json", help="Print one JSON object.")
#: the declared options suggest and submit place themselves (``request_options`` places the rest)
_SEQ = option(FIELDS["seq_len"])
_TIMELINE = typer.Option(None, "--timeline", help="Write a picture of memory over one step: a .svg, .png or .html file.")


def request_options(fields: Iterable[RequestField], *, after: str) -> Callable:
    """A command with an option per declared field in ``fields``, placed after its parameter
    ``after`` (where ``--help`` lists them); the command takes them as keywords (``**options``).
    Typer reads the parameters from the signature, which is rewritten here (the command's own
    annotations stay strings: typer evaluates them in the command's module, as for any command)."""
    fields = tuple(fields)

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func)
        params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        at = [p.name for p in params].index(after) + 1
        added = [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option(f),
                                   annotation=_annotation(f)) for f in fields]
        params[at:at] = added

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            if values.get("transformers") is not None:  # the knobs given explicitly win over the version's
                values["stated"] = _stated(values)
            return func(**values)

        command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _stated(values: dict[str, Any]) -> tuple[str, ...]:
    """The options of ``values`` given on the command line (or by an environment variable), not defaulted:
    with --transformers, they keep their values (``planner.estimation.versioned``)."""
    import importlib

    from planner.cli._click import click_module

    name = click_module().__name__  # typer's vendored click names neither at its top (its globals and core do)
    ctx = importlib.import_module(f"{name}.globals").get_current_context(silent=True)
    if ctx is None:  # called as a function, not parsed: those set on (the Python API's rule)
        return tuple(key for key, value in values.items() if value is True)
    source = importlib.import_module(f"{name}.core").ParameterSource
    given = (source.COMMANDLINE, source.ENVIRONMENT)
    return tuple(name for name in values if ctx.get_parameter_source(name) in given)


def _resolve(model: str, gpu: str, gpu_mem: Optional[str], db: Optional[str]):
    """The model and the device, with the device's active calibration (``planner calibrate``)."""
    from planner.calibration import apply_calibration
    from planner.calibration.lookup import active_calibration
    from planner.cli._common import catalog_gpu, console_to_stderr
    from planner.estimation import resolve
    from planner.units import parse_bytes

    gpu = catalog_gpu(gpu)
    memory = parse_bytes(gpu_mem, option="--gpu-mem") if gpu_mem is not None else None
    spec, device = resolve(model=model, gpu=gpu, gpu_mem_bytes=memory)  # bad input fails before the store is read
    calibration, note = active_calibration(device.name, db=db)
    if note:
        console_to_stderr().print(note)
    return spec, apply_calibration(device, calibration)


def _config_options(options: dict[str, Any], *, gpus: int) -> dict[str, Any]:
    """The TrainConfig options of a command's ``options`` (``planner.estimation.CONFIG_OPTIONS``)."""
    from planner.estimation import CONFIG_OPTIONS

    options = {**options, "gpus": gpus}
    return {key: options[key] for key in CONFIG_OPTIONS}


def _bar(breakdown: dict[str, int], capacity: int, width: int = 60) -> list[str]:
    """A stacked bar of the breakdown against the device capacity, one letter per component."""
    groups: dict[str, int] = {}
    for key, value in breakdown.items():
        groups[key.split("/")[0]] = groups.get(key.split("/")[0], 0) + value
    total = max(capacity, sum(groups.values()))
    bar, legend = "", []
    used_letters: set[str] = set()
    for name, value in sorted(groups.items(), key=lambda kv: -kv[1]):
        # the component's initial, or the next free letter of its name
        letter = next((ch.upper() for ch in name if ch.isalpha() and ch.upper() not in used_letters), "?")
        used_letters.add(letter)
        cells = round(value / total * width)
        bar += letter * cells
        legend.append(f"{letter}={name}")
    used = len(bar)
    cap_cells = round(capacity / total * width)
    bar = bar.ljust(cap_cells, ".")
    return [f"[{bar[:width]}] {'over capacity' if used > cap_cells else ''}".rstrip(), "  " + "  ".join(legend)]


def _print_estimate(out, data: dict[str, Any], estimate, *, encoder: bool = False) -> None:
    from rich.table import Table

    from planner.sharding import decode
    from planner.units import format_bytes

    m, cfg, dev = data["model"], data["config"], data["device"]
    from planner.cli.models_cmd import format_params

    notes = "".join(f" ({what} {m[key]})" for key, what in (("architecture_of", "architecture of"),
                                                            ("language_model_of", "language model of the wrapper")) if key in m)
    active = m.get("active_params", m["params"])  # MoE: what each token passes through
    per_token = f" ({format_params(active)} active per token)" if active != m["params"] else ""
    out.print(f"{m['id']}{notes}: {format_params(m['params'])} parameters{per_token}, "
              f"{format_params(m['trainable_params'])} trainable")
    out.print(f"config: {cfg['method']}, {cfg['precision']}, {cfg['optimizer']}, micro-batch {cfg['micro_batch']} x accum {cfg['grad_accum']}"
              f" x {cfg['gpus']} GPU, seq {cfg['seq_len']}, ckpt {'on' if cfg['grad_ckpt'] else 'off'}, {decode(cfg).words()}")
    recipe = _recipe_line(cfg, encoder=encoder)
    if recipe:
        out.print(f"recipe: {recipe}", markup=False)
    table = Table(title=f"memory per device at the peak ({estimate.peak_phase})")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    peak = estimate.peak_allocated_bytes
    for key, value in sorted(estimate.breakdown.items(), key=lambda kv: -kv[1]):
        table.add_row(key, format_bytes(value), f"{value / peak:.1%}")
    table.add_row("peak allocated", format_bytes(peak), "", style="bold")
    table.add_row("peak reserved", format_bytes(estimate.peak_reserved_bytes), "")
    table.add_row("process total (nvidia-smi)", format_bytes(estimate.process_total_bytes), "", style="bold")
    if estimate.cpu_bytes:
        table.add_row("host RAM (offload)", format_bytes(estimate.cpu_bytes), "")
    if estimate.paged_bytes:
        table.add_row("paged optimizer states (unified memory)", format_bytes(estimate.paged_bytes), "")
        table.add_row("  of them on the host at the step", format_bytes(estimate.paged_host_bytes), "")
    out.print(table)
    for line in _bar(dict(estimate.breakdown), dev["capacity_bytes"]):
        out.print(line, markup=False)
    verdict = "fits" if data["fits"] else "does NOT fit"
    out.print(f"{dev['name']}: {format_bytes(dev['capacity_bytes'])}, {format_bytes(dev['usable_bytes'])} usable after the safety margin: {verdict}"
              f" (headroom {format_bytes(dev['usable_bytes'] - estimate.process_total_bytes)})")
    from planner.cli.suggest_view import _risk

    low, high = data["memory"]["peak_interval_bytes"]
    out.print(f"how sure: process total {format_bytes(low)}-{format_bytes(high)} (90% interval), OOM risk "
              f"{_risk(data['oom_probability'])}{', near the edge (over 5%)' if data['near_edge'] else ''}: from the memory "
              "model's error on published runs (README, \"How sure\")", markup=False)
    t = data["throughput"]
    out.print(f"throughput: {t['tokens_per_s']:,.0f} tokens/s, {t['step_s']:.3g} s per optimizer step")
    for note in list(estimate.assumptions) + list(t.get("assumptions", [])):
        out.print(f"  assumption: {note}", markup=False)


def _recipe_line(cfg: dict[str, Any], *, encoder: bool = False) -> str:
    """The recipe settings that differ from the HF Trainer defaults, for the config line."""
    from planner.request import recipe_words

    return recipe_words(cfg, encoder=encoder)


def _print_sparkline(out, spec, device, config, memory) -> None:
    """The predicted curve of one step as one line (reserved where an allocator is replayed)."""
    from planner.estimation import step_curves
    from planner.plot import sparkline
    from planner.units import format_bytes

    curves = step_curves(spec=spec, gpu=device, config=config)
    line = sparkline(curves.allocated)
    out.print(f"one step: {line} peak {format_bytes(memory.peak_allocated_bytes)} at {memory.peak_phase}"
              + (f", reserved {format_bytes(memory.peak_reserved_bytes)}" if curves.reserved is not None else ""), markup=False)


#: ``planner estimate``'s exit code for a configuration that does not fit the usable memory (the
#: same code as ``planner suggest`` when nothing fits: NothingFitsError.exit_code).
DOES_NOT_FIT = 3


@request_options(ESTIMATE, after="gpu_mem")
def estimate(
    model: str = _MODEL, gpu: str = _GPU, gpus: int = _GPUS, gpu_mem: Optional[str] = _GPU_MEM,
    timeline: Optional[str] = _TIMELINE, as_json: bool = _JSON,
    db: Optional[str] = typer.Option(None, "--db", help="Database URL to read the device's calibration from (default: PLANNER_DATABASE_URL or the local SQLite file)."),
    solve: Optional[str] = typer.Option(None, "--solve", help="seq-len | micro-batch: also the longest sequence (or largest micro-batch) this configuration fits, and the longest that is not near the edge."),
    **options: Any,
) -> None:
    """Predict memory and speed of ONE fully specified training configuration (exit 3 when it does not fit)."""
    from planner.cli._common import console, print_json
    from planner.estimation import build_config, draw_step, estimate_configuration, model_as_run, versioned

    if timeline is not None:
        from planner.plot import check_path

        check_path(timeline)
    spec, device = _resolve(model, gpu, gpu_mem, db)
    options = versioned(spec, options, stated=options.pop("stated", None))  # --transformers' knobs for this model
    spec = model_as_run(spec, options)
    seq_len = options["seq_len"]
    data, memory = estimate_configuration(spec=spec, gpu=device, seq_len=seq_len, **_config_options(options, gpus=gpus))
    config = build_config(spec, device, seq_len=seq_len, **_config_options(options, gpus=gpus))
    if timeline is not None:
        data["timeline"] = draw_step(spec=spec, gpu=device, config=config, estimate=memory, path=timeline)
    solved = _solve(solve, spec=spec, device=device, config=config)
    if solved is not None:
        data["solved"] = solved.to_dict()
    if as_json:
        print_json(data)
    else:
        out = console()
        _print_estimate(out, data, memory, encoder=spec.is_encoder)
        _print_sparkline(out, spec, device, config, memory)
        if timeline is not None:
            out.print(f"timeline: {data['timeline']}", markup=False)
        if solved is not None:
            out.print(_solved_line(solved, config), markup=False)
    if not data["fits"]:
        raise typer.Exit(DOES_NOT_FIT)  # the estimate is printed in full; scripts read the code


def _solve(size: str | None, *, spec, device, config):
    """``--solve seq-len|micro-batch``: ``planner.solve``'s answer for this configuration, or None."""
    if size is None:
        return None
    from planner import solve

    solvers = {"seq-len": solve.longest_seq_len, "micro-batch": solve.largest_micro_batch}
    if size not in solvers:
        from planner.errors import InvalidConfigError

        raise InvalidConfigError(f"--solve must be one of {'|'.join(solvers)}, got {size!r}")
    return solvers[size](spec=spec, gpu=device, config=config)


def _solved_line(solved, config) -> str:
    from planner.solve import eval_tokens_past_seq_len
    from planner.units import format_bytes

    what = "sequence" if solved.size == "seq_len" else "micro-batch"
    if not solved.fits:
        return f"longest {what} that fits: none (not even 1)"
    line = f"longest {what} that fits: {solved.fits:,} ({format_bytes(solved.fits_total)} of {format_bytes(solved.usable)} usable)"
    if solved.fits == solved.limit:
        line += ", the most this model takes" if solved.size == "seq_len" else ", the most the planner tries"
        if solved.size == "seq_len" and (generated := eval_tokens_past_seq_len(config)):
            line += f" beside the {generated:,} tokens the eval pass generates"
    safe = (f"{solved.safe:,} ({format_bytes(solved.safe_total)})" if solved.safe
            else "none (every length that fits is near the edge)")
    return line + f"; not near the edge (at most 5% chance of running out): {safe}"


@request_options(ESTIMATE, after="gpu_mem")
def measure(
    model: str = _MODEL, gpu: str = typer.Option("cpu", "--gpu", "-g", help="cpu (here) or the GPU the run is on."),
    gpus: int = _GPUS, gpu_mem: Optional[str] = _GPU_MEM,
    timeline: Optional[str] = _TIMELINE,
    steps: int = typer.Option(3, "--steps", help="Optimizer steps to run (the last one is measured)."),
    timeout: float = typer.Option(900, "--timeout", help="Seconds before the run is killed."),
    db: Optional[str] = typer.Option(None, "--db", help="Database URL (default: PLANNER_DATABASE_URL or the local SQLite file)."),
    no_save: bool = typer.Option(False, "--no-save", help="Do not store the measurement."),
    as_json: bool = _JSON,
    **options: Any,
) -> None:
    """Train the configuration for a few real steps in a fresh process and compare with the prediction."""
    from planner.cli._common import console, print_json
    from planner.errors import InvalidConfigError, MissingDependencyError, UnsupportedError
    from planner.estimation import build_config, check_runs_installed, estimate_dict
    from planner.memory import estimate_memory
    from planner.search import safety_margin
    from planner.throughput import estimate_throughput
    from planner.verify.driver import MEASURE_MAX_STEPS, check_run_limits

    check_runs_installed(options, command="planner measure's steps")  # its worker trains with transformers 5
    # a run's steps (2 to MEASURE_MAX_STEPS) and timeout (0-86400 s; NaN refused too),
    # before anything is resolved or started: --timeout nan reached the child process's wait
    check_run_limits(steps=steps, timeout_s=timeout, timeout_option="--timeout", max_steps=MEASURE_MAX_STEPS)
    if timeline is not None:
        from planner.plot import check_path

        check_path(timeline)
    spec, device = _resolve(model, gpu, gpu_mem, db)
    if gpus != 1:
        raise InvalidConfigError("planner measure runs on one device: use --gpus 1 (ZeRO runs as one rank)")
    config = build_config(spec, device, seq_len=options["seq_len"], **_config_options(options, gpus=gpus))
    if str(config.precision) == "fp8":  # on an FP8 GPU (build_config refused it elsewhere, the cpu profile included)
        raise UnsupportedError("planner measure does not run fp8: its worker trains with torch autocast, not "
                               "torchao's float8 linears; measure --precision bf16-mixed, or run the plan "
                               "planner emit writes with accelerate launch")
    _check_worker_libraries(config)
    if not device.is_cpu:
        import torch

        if not torch.cuda.is_available():
            raise MissingDependencyError(
                f"--gpu {device.name}: this machine has no CUDA device (or torch is a CPU build): run on a "
                f"machine with a {device.display_name}, or measure here with --gpu cpu"
            )
    predicted = estimate_memory(model=spec, config=config, gpu=device)
    throughput = estimate_throughput(model=spec, config=config, gpu=device,
                                     paged_host=predicted.paged_host_bytes)
    import workers

    # on the CPU, --gpu-mem is enforced: an allocation past it makes the run an "oom" outcome
    limit = device.memory_bytes if device.is_cpu and gpu_mem is not None else None
    measured, details = workers.measure_with_details(
        model_config=spec.config, config=config, device="cpu" if device.is_cpu else "cuda", steps=steps,
        timeout_s=timeout, memory_limit_bytes=limit)
    usable = device.memory_bytes - safety_margin(device.memory_bytes)
    data = estimate_dict(spec, device, config, predicted, throughput, usable)
    data["measurement"] = measured.to_dict()
    if timeline is not None:
        from planner.estimation import draw_step

        data["timeline"] = draw_step(spec=spec, gpu=device, config=config, estimate=predicted, path=timeline,
                                     measured=details.get("memory_events"), measured_phases=details.get("memory_phases"))
    data["error_pct"] = _errors(predicted, throughput, measured)
    out = console()
    if not no_save:
        data["plan_id"] = _save(spec, device, config, predicted, throughput, measured, fits=data["fits"], db=db)
    if as_json:
        print_json(data)
    else:
        _print_measurement(out, data, predicted, measured)
        if data.get("plan_id"):
            out.print(f"plan id: {data['plan_id']}")
        if data.get("timeline"):
            out.print(f"timeline: {data['timeline']} (measured over predicted)", markup=False)
    if str(measured.outcome) != "ok":
        raise typer.Exit(1)


def _errors(predicted, throughput, measured) -> dict[str, float | None]:
    """(predicted - measured) / measured in percent, where the run measured the quantity."""
    out = {
        key: (100.0 * (getattr(predicted, key) - getattr(measured, key)) / getattr(measured, key))
        if getattr(measured, key) else None
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "process_total_bytes")
    }
    out["tokens_per_s"] = (
        100.0 * (throughput.tokens_per_s - measured.tokens_per_s) / measured.tokens_per_s if measured.tokens_per_s else None
    )
    return out


def _save(spec, device, config, predicted, throughput, measured, *, fits: bool, db) -> str:
    """Store the prediction with its measurement; the plan id."""
    from planner.catalog import fingerprint
    from planner.cli.store import save_measurement
    from planner.results import Candidate, PlanRequest

    request = PlanRequest(
        model_id=spec.id, model_fingerprint=fingerprint(spec), gpu=device.name, gpu_count=1,
        gpu_memory_bytes=device.memory_bytes, target_batch=config.global_batch, seq_len=config.seq_len,
        constraints={"measure": config.to_dict()},
    )
    candidate = Candidate(config=config, memory=predicted, throughput=throughput, fits=fits, rank=1)
    return save_measurement(request=request, candidate=candidate, measurement=measured, db=db)


def _check_worker_libraries(config) -> None:
    """One line, before anything runs or is stored, when the run would need a library that the
    light install does not have."""
    import importlib.util

    from planner.config import Method
    from planner.errors import MissingDependencyError
    from planner.optim import OPTIMIZERS

    needed = ["torch", "transformers", "accelerate"]
    if config.method.uses_adapters:
        needed.append("peft")
    if config.method is Method.QLORA:
        needed.append("bitsandbytes")
    library = OPTIMIZERS[config.optimizer].library
    if library and library not in needed:
        needed.append(library)
    library = config.sharding.spec.library  # the sharding scheme's (planner.sharding)
    if library and library not in needed:
        needed.append(library)
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"planner measure trains for real and needs {', '.join(missing)}, which are not installed: "
            "pip install 'oom-planner[workers]' (on a GPU machine install a CUDA build of torch first)"
        )


def _print_measurement(out, data, predicted, measured) -> None:
    from rich.table import Table

    from planner.sharding import decode
    from planner.units import format_bytes

    out.print(f"{data['model']['id']} on {measured.device}: {data['config']['method']}, {data['config']['precision']}, "
              f"{data['config']['optimizer']}, micro-batch {data['config']['micro_batch']} x {data['config']['grad_accum']}, "
              f"seq {data['config']['seq_len']}, ckpt {'on' if data['config']['grad_ckpt'] else 'off'}, "
              f"{decode(data['config']).words(offload_none=False)}")
    recipe = _recipe_line(data["config"])
    if recipe:  # the knobs the run was trained with, as estimate prints them
        out.print(f"recipe: {recipe}", markup=False)
    out.print(f"outcome: {measured.outcome}" + (f" ({measured.error})" if measured.error else ""), markup=False)
    table = Table(title="predicted vs measured")
    table.add_column("")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("error", justify="right")
    for key, label in (("peak_allocated_bytes", "peak allocated"), ("peak_reserved_bytes", "peak reserved"), ("process_total_bytes", "process total")):
        m = getattr(measured, key)
        if m is None:
            continue
        err = data["error_pct"][key]
        table.add_row(label, format_bytes(getattr(predicted, key)), format_bytes(m), f"{err:+.1f}%" if err is not None else "")
    if measured.tokens_per_s:
        table.add_row("tokens/s", f"{data['throughput']['tokens_per_s']:,.0f}", f"{measured.tokens_per_s:,.0f}",
                      f"{data['error_pct']['tokens_per_s']:+.0f}%")
    if not table.row_count:  # a run that ended before its measured step: no empty table, the prediction alone
        out.print(f"nothing was measured (the run ended before its measured step); predicted: peak allocated "
                  f"{format_bytes(predicted.peak_allocated_bytes)}, process total "
                  f"{format_bytes(predicted.process_total_bytes)}, {data['throughput']['tokens_per_s']:,.0f} tokens/s",
                  markup=False)
        return
    out.print(table)
    if measured.tokens_per_s and measured.device == "cpu":
        out.print("tokens/s: the throughput model counts FLOPs and memory traffic for GPUs; on the CPU a small model's "
                  "step is mostly per-op overhead, which it does not model")


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
    app.command("measure")(measure)
