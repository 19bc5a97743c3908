"""``planner suggest``: search the whole space against a target batch, rank, store and print."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import typer

from planner.cli._common import catalog_gpu, console_to_stderr
from planner.cli.plan import _GPUS, _JSON, _MODEL, _SEQ, option, request_options
from planner.request import RECIPE, SEARCH

if TYPE_CHECKING:  # pragma: no cover
    from planner.dataset import DataPlan
    from planner.modelspec import ModelSpec

#: ``--gpu any``: every catalog GPU type and count, compared by cost and time (``planner.rent``)
ANY_GPU = "any"

_VERIFY_HELP = "Verify the top candidates with short real runs on Ray workers (embedded Ray, or --ray-address)."
# Options suggest shares with planner submit (one definition, two commands; the request's from
# their declaration, planner.request).
TARGET_BATCH = option(SEARCH["target_batch"])
GPU_MEM = typer.Option(None, "--gpu-mem", help="Override the device memory, e.g. 20GiB (with --gpu cpu: the limit verification runs are held to).")
METHOD = option(SEARCH["method"])
PRECISION = option(SEARCH["precision"])
NO_OFFLOAD = typer.Option(False, "--no-offload", help="Do not consider DeepSpeed CPU offload.")
CPU_MEM = typer.Option(None, "--cpu-mem", help="Host RAM of the node for offload, e.g. 192GiB (default: the catalog's standard machine with --gpus of this GPU; this machine's with --gpu cpu/auto; offload needs it where the catalog knows none).")
PREFER = option(SEARCH["prefer"])
TOP_K = option(SEARCH["top_k"])
VERIFY_TOP = typer.Option(3, "--verify-top", help="Candidates to verify fitting (default: 3).")
STEPS = typer.Option(3, "--steps", help="Optimizer steps per verification run; the last is measured (default: 3).")
RUN_TIMEOUT = typer.Option(900, "--run-timeout", help="Seconds before a verification run is killed (default: 900).")
SUGGEST_GPU = typer.Option(..., "--gpu", "-g", help="GPU name from 'planner gpus' (cpu: the CPU measurement profile; auto: this machine's GPU, through NVML; any: every catalog GPU type on 1, 2, 4 and 8 GPUs, ranked by cost and time, see --tokens; or a comma list such as a10g,l4,a100-80gb).")
GPUS_MAX = typer.Option(8, "--gpus-max", help="With --gpu any: the most GPUs of one node to compare (default: 8).")
TOKENS = typer.Option(None, "--tokens", help="With --gpu any: tokens the job trains, e.g. 1e9, 500M, 2B (default: one billion).")
EPOCHS = typer.Option(None, "--epochs", help="With --gpu any: epochs over --dataset-tokens (or over --dataset's rows), instead of --tokens.")
DATASET_TOKENS = typer.Option(None, "--dataset-tokens", help="With --gpu any and --epochs: tokens of one epoch, e.g. 120M.")
PRICES = typer.Option(None, "--prices", help="With --gpu any: your own prices, a JSON or YAML file mapping GPU names to dollars per GPU-hour (replaces the shipped table).")


@request_options(RECIPE, after="prefer")
def suggest(
    model: str = _MODEL,
    gpu: str = SUGGEST_GPU,
    target_batch: int = TARGET_BATCH,
    seq_len: Optional[int] = _SEQ,
    gpus: int = _GPUS,
    gpu_mem: Optional[str] = GPU_MEM,
    method: str = METHOD,
    precision: str = PRECISION,
    no_offload: bool = NO_OFFLOAD,
    cpu_mem: Optional[str] = CPU_MEM,
    top_k: int = TOP_K,
    prefer: str = PREFER,
    verify: bool = typer.Option(False, "--verify", help=_VERIFY_HELP),
    verify_top: int = VERIFY_TOP,
    steps: int = STEPS,
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster to run on: auto, HOST:6379 or ray://HOST:10001 (default: $RAY_ADDRESS, else Ray embedded here)."),
    run_timeout: float = RUN_TIMEOUT,
    fresh: bool = typer.Option(False, "--fresh", help="Plan again even when a verified plan for this request is stored."),
    emit: Optional[str] = typer.Option(None, "--emit", help="Write the chosen plan's ready-to-run files (train.py, training_args.json, ...) to this new directory."),
    force: bool = typer.Option(False, "--force", help="With --emit: write into a directory that already holds files."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Your training data (.jsonl with input_ids, text or messages; .txt; .parquet; a folder saved with datasets' save_to_disk): plans for its longest batch (padded: the longest sample; packed: --seq-len); with --emit, train.py's default dataset (a datasets name only goes to train.py)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="With --dataset: a local tokenizer.json (or its folder) to count tokens (default: the model's own beside its config.json, else 4 bytes per token, said so)."),
    dataset_field: Optional[str] = typer.Option(None, "--dataset-field", help="With --dataset: the text or token column (default: input_ids, then text, then messages)."),
    gpus_max: int = GPUS_MAX,
    tokens: Optional[str] = TOKENS,
    epochs: Optional[float] = EPOCHS,
    dataset_tokens: Optional[str] = DATASET_TOKENS,
    prices: Optional[str] = PRICES,
    max_seq: bool = typer.Option(False, "--max-seq", help="Also the longest sequence each plan shown fits (its micro-batch and the rest as planned), and the longest that is not near the edge (a bisection on the full estimate: about 40 estimates a plan)."),
    plan_id: Optional[str] = typer.Option(None, "--plan-id", hidden=True, help="Verify this stored plan of the same request (planner submit's jobs)."),
    db: Optional[str] = typer.Option(None, "--db", help="Database URL (default: PLANNER_DATABASE_URL or the local SQLite file)."),
    no_save: bool = typer.Option(False, "--no-save", help="Do not store this plan."),
    as_json: bool = _JSON,
    **recipe: Any,
) -> None:
    """Search every configuration that reaches --target-batch and rank what fits: by default the most
    faithful method first (full > LoRA > QLoRA > full in pure 16-bit, narrowed by --method), then the
    fastest; --prefer speed ranks by speed alone. A plan near the edge of the device ranks after the
    ones that are not.

    With --verify, the top candidates are trained for a few real steps on Ray workers and the
    fastest that fits when run is the answer."""
    from planner.cli._common import console

    comparing = gpu.strip().lower() == ANY_GPU or "," in gpu  # which GPU to rent (planner.rent)
    if max_seq and comparing:
        from planner.errors import InvalidConfigError

        raise InvalidConfigError("--max-seq solves the plans of one GPU: pick one from the comparison, then run "
                                 "planner suggest --gpu NAME --max-seq")
    compare = {"--gpus-max": gpus_max != GPUS_MAX.default, "--tokens": tokens, "--epochs": epochs,
               "--dataset-tokens": dataset_tokens, "--prices": prices}
    if comparing:
        _compare(model=model, gpu_names=None if gpu.strip().lower() == ANY_GPU else gpu.split(","), target_batch=target_batch, seq_len=seq_len, gpus=gpus, gpu_mem=gpu_mem, method=method,
                 precision=precision, no_offload=no_offload, cpu_mem=cpu_mem, prefer=prefer, recipe=recipe,
                 verify=verify, emit=emit, dataset=dataset, tokenizer=tokenizer, dataset_field=dataset_field,
                 gpus_max=gpus_max, tokens=tokens, epochs=epochs, dataset_tokens=dataset_tokens, prices=prices,
                 as_json=as_json, db=db)
        return
    given = next((flag for flag, value in compare.items() if value), None)
    if given is not None:
        from planner.errors import InvalidConfigError

        raise InvalidConfigError(f"{given} compares GPUs: add --gpu any (or a comma list of GPUs), or drop {given}")
    if no_save and (verify or plan_id or emit):
        from planner.errors import InvalidConfigError

        raise InvalidConfigError(f"{'--emit' if emit else '--verify'} works from the stored plan: drop --no-save")
    if emit is not None or verify or plan_id is not None:  # what they run is transformers 5's (as planner emit's)
        from planner.estimation import check_runs_installed

        check_runs_installed(recipe, command="--emit's files" if emit is not None else "--verify's workers",
                             fix="plan that version without it (planner suggest --transformers ...)")
    if emit is not None:
        from planner.emit import check_directory

        check_directory(emit, force=force)  # a directory holding other files fails before anything is planned
    # --verify-top, --steps and --run-timeout are checked with or without --verify (a bad value was
    # ignored without it; with it, refused)
    checked = _verify_options(verify_top=verify_top, steps=steps, ray_address=ray_address, run_timeout=run_timeout)
    options = checked if verify else None
    if options is not None or plan_id is not None:
        from planner.verify.cluster import check_joined, import_ray

        import_ray()  # Ray missing, or an unreachable cluster: one line before anything is planned or stored
        check_joined(ray_address)  # --ray-address, else $RAY_ADDRESS: each named as such in its message
    spec = None  # the model resolved once for the data's lengths is the one planned
    if dataset is not None:
        seq_len, spec, _data = _seq_len_of_data(dataset, model=model, target_batch=target_batch, seq_len=seq_len,
                                   packing=recipe.get("packing", True), tokenizer=tokenizer, field=dataset_field,
                                   recipe=recipe)
    elif tokenizer is not None or dataset_field is not None:
        from planner.errors import InvalidConfigError

        raise InvalidConfigError("--tokenizer and --dataset-field read the data of --dataset: add --dataset FILE")
    request = _request(model=model, gpu=catalog_gpu(gpu), target_batch=target_batch, seq_len=seq_len, gpus=gpus, gpu_mem=gpu_mem,
                       method=method, precision=precision, no_offload=no_offload, cpu_mem=cpu_mem, top_k=top_k,
                       prefer=prefer, local_node=gpu.strip().lower() == "auto",
                       recipe=recipe)
    # plan_request (planner.usecases): the search, then the same request's stored plan (answered
    # from when verified), then the new plan stored; --plan-id verifies a stored plan instead
    reuse = not fresh and not no_save and plan_id is None
    outcome = _plan(request, as_json=as_json, db=db, say_unread=no_save, store=plan_id is None, reuse=reuse,
                    save=not no_save, spec=spec)
    planned = outcome.planned
    out = console() if not as_json else console_to_stderr()
    if outcome.reused is not None:
        _answer_from_store(out, outcome.reused, device=planned.device, as_json=as_json)
        _emit(out, outcome.reused.id, directory=emit, force=force, dataset=dataset, db=db)
        return
    if plan_id is not None:
        target = _adopt(plan_id, planned=planned, db=db)
        if not as_json:
            from planner.cli.suggest_view import print_suggestion

            print_suggestion(out, planned.result, spec=planned.spec, device=planned.device, seq_defaulted=planned.seq_defaulted,
                             host=planned.host_bytes, no_offload=no_offload, host_source=planned.host_source)
            out.print(f"plan id: {target}")
    else:
        solved = _longest_contexts(planned) if max_seq else None
        target = _save_and_print(out, outcome, save=not no_save, no_offload=no_offload, print_table=not as_json,
                                 print_json_plan=as_json and options is None,
                                 extra={"max_seq": [s.to_dict() for s in solved]} if solved is not None else None)
        if solved is not None and not as_json:
            _print_longest_contexts(out, planned.result.plans, solved)
    if options is not None or plan_id is not None:
        # a plan whose verification failed exits 1 here, and nothing is emitted for it
        _verify(out, target, planned=planned, db=db, options=options or checked, as_json=as_json)
    _emit(out, target, directory=emit, force=force, dataset=dataset, db=db)


def _seq_len_of_data(dataset: str, *, model: str, target_batch: int, seq_len: int | None, packing: bool,
                     tokenizer: str | None, field: str | None,
                     recipe: dict | None = None) -> "tuple[int | None, ModelSpec, DataPlan | None]":
    """The sequence length to plan for: the longest row the data makes (``planner.dataset``), said
    on stderr with the lengths it read; ``seq_len`` as given when ``dataset`` is no local file. With
    it, the model it resolved, which the search then plans (not resolved a second time), and what
    was read of the data (None: no local file)."""
    from pathlib import Path

    from planner.catalog import resolve_model
    from planner.config import context_limit
    from planner.dataset import PROGRESS_BYTES, plan_for_data

    spec = resolve_model(model)
    err = console_to_stderr()
    progress, bar = None, None
    source = Path(dataset).expanduser()
    if err.is_terminal and source.is_file() and source.stat().st_size >= PROGRESS_BYTES:
        from rich.progress import Progress

        bar = Progress(console=err, transient=True)
        task = bar.add_task(f"reading {source.name}", total=source.stat().st_size)
        bar.start()

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
    try:
        planned = plan_for_data(dataset, config_source=spec.source, model_max=context_limit(spec, recipe),
                                target_batch=target_batch, packing=packing, seq_len=seq_len, tokenizer=tokenizer,
                                field=field, progress=progress)
    finally:
        if bar is not None:
            bar.stop()
    if planned is None:
        err.print(f"--dataset {dataset}: no local file, so its lengths are not read (train.py loads it); planning "
                  "for --seq-len", markup=False, soft_wrap=True)
        return seq_len, spec, None
    err.print(planned.describe(), markup=False, soft_wrap=True)
    return planned.batches.seq_len, spec, planned


def _emit(out, plan_id: str | None, *, directory: str | None, force: bool, dataset: str | None, db) -> None:
    """``--emit DIR``: the chosen plan's files, the fastest verified one when the plan was
    verified, else the first that is not near the edge (``planner emit`` for another rank)."""
    if directory is None or plan_id is None:
        return
    from pathlib import Path

    from planner.answers import answer_position
    from planner.emit import write_plan_files
    from planner.store.interface import open_plan_store

    with open_plan_store(url=db) as store:
        plan = store.get_plan(plan_id=plan_id)
    answer = answer_position(plan) if plan.verified else None
    if answer is not None:
        rank = plan.candidates[answer].candidate.rank
    else:  # the first plan that is not near the edge: one that is is never written by default
        from planner.uncertainty import NEAR_EDGE_PROBABILITY

        safe = [c.candidate.rank for c in plan.candidates if c.candidate.rank is not None
                and (c.candidate.memory.oom_probability or 0.0) <= NEAR_EDGE_PROBABILITY]
        if not safe:
            out.print(f"nothing written to {directory}: every plan is near the edge (over "
                      f"{NEAR_EDGE_PROBABILITY:.0%} chance of running out of memory); `planner emit {plan_id} "
                      f"{directory} --rank 1` writes plan #1 anyway", markup=False)
            return
        rank = min(safe)
    written = write_plan_files(plan=plan, rank=rank, directory=Path(directory), force=force, dataset=dataset)
    out.print(f"wrote {len(written)} files for plan #{rank} to {directory}: " + ", ".join(p.name for p in written),
              markup=False)


def _request(*, model, gpu, target_batch, seq_len, gpus, gpu_mem, method, precision, no_offload, cpu_mem, top_k,
             prefer="fidelity", local_node=False, recipe=None):
    from planner.planning import SuggestRequest
    from planner.units import parse_bytes

    return SuggestRequest(
        model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus,
        gpu_mem_bytes=parse_bytes(gpu_mem, option="--gpu-mem") if gpu_mem is not None else None,
        method=method, precision=precision, allow_offload=not no_offload,
        cpu_mem_bytes=parse_bytes(cpu_mem, option="--cpu-mem") if cpu_mem is not None else None, top_k=top_k,
        prefer=prefer, local_node=local_node,
        **(recipe or {}),
    )


def _compare(*, model, gpu_names, target_batch, seq_len, gpus, gpu_mem, method, precision, no_offload, cpu_mem, prefer, recipe,
             verify, emit, dataset, tokenizer, dataset_field, gpus_max, tokens, epochs, dataset_tokens, prices,
             as_json, db) -> None:
    """``--gpu any`` (or a comma list of GPU names): the request planned on every catalog GPU type
    (or those) and count (``planner.rent``), printed cheapest first (``--json``: every option)."""
    from planner import gpus as catalog  # (gpu_names here is the request's list)
    from planner.calibration.lookup import active_calibrations
    from planner.cli._common import console, print_json
    from planner.cli.rent_view import print_comparison
    from planner.errors import InvalidConfigError
    from planner.pricing import load_prices
    from planner.rent import compare_gpus, parse_tokens, usable_cpus, workload

    refused = {"--verify": verify, "--emit": emit, f"--gpus {gpus}": gpus != 1, "--gpu-mem": gpu_mem}
    given = next((flag for flag, value in refused.items() if value), None)
    if given is not None:
        why = ("--gpus-max bounds the counts compared" if given.startswith("--gpus")
               else "each GPU is planned with its own memory" if given == "--gpu-mem"
               else "pick one of the options, then run planner suggest --gpu NAME --gpus N with it")
        raise InvalidConfigError(f"{given} does not go with --gpu any: {why}")
    table = load_prices(prices)  # a bad price file fails before anything is planned
    job_tokens = parse_tokens(tokens) if tokens is not None else None
    epoch_tokens = parse_tokens(dataset_tokens, option="--dataset-tokens") if dataset_tokens is not None else None
    spec, epoch_source = None, "--dataset-tokens"
    if dataset is not None:
        from planner.dataset import is_datasets_name

        if epochs is not None and epoch_tokens is None and is_datasets_name(dataset):
            raise InvalidConfigError(f"--epochs over --dataset {dataset}: a datasets name is not read here, so an "
                                     "epoch's tokens are unknown: add --dataset-tokens N, or give a local file")
        seq_len, spec, data = _seq_len_of_data(dataset, model=model, target_batch=target_batch, seq_len=seq_len,
                                               packing=recipe.get("packing", True), tokenizer=tokenizer,
                                               field=dataset_field, recipe=recipe)
        if data is not None and epochs is not None and epoch_tokens is None:
            # what the trainer processes in an epoch at the planned row length (padding included):
            # the tokens the plans' tokens/s count
            batches = data.batches
            epoch_tokens, epoch_source = batches.steps_per_epoch * target_batch * batches.seq_len, f"--dataset {dataset}"
    elif tokenizer is not None or dataset_field is not None:
        raise InvalidConfigError("--tokenizer and --dataset-field read the data of --dataset: add --dataset FILE")
    job = workload(tokens=job_tokens, epochs=epochs, epoch_tokens=epoch_tokens, epoch_source=epoch_source)
    request = _request(model=model, gpu=ANY_GPU, target_batch=target_batch, seq_len=seq_len, gpus=1, gpu_mem=None,
                       method=method, precision=precision, no_offload=no_offload, cpu_mem=cpu_mem, top_k=1,
                       prefer=prefer, recipe=recipe)
    calibrations, note = active_calibrations(catalog.gpu_names(), db=db)
    if note:
        console_to_stderr().print(note)
    comparison = compare_gpus(request, workload=job, prices=table, gpus_max=gpus_max, spec=spec,
                              gpu_names=gpu_names, calibration_of=calibrations.get, processes=usable_cpus())
    if as_json:
        print_json(comparison.to_dict())
    else:
        print_comparison(console(), comparison)
    if not comparison.by_time():  # (printed first: each option's reason is in the answer)
        from planner.errors import NothingFitsError

        raise NothingFitsError(f"nothing fits on any GPU compared at 1 to {gpus_max} GPUs: try --method qlora, "
                               "a shorter --seq-len or a smaller --target-batch")


def _verify_options(*, verify_top, steps, ray_address, run_timeout):
    from planner.verify.driver import VerifyOptions

    return VerifyOptions(top=verify_top, steps=steps, address=ray_address, timeout_s=run_timeout)


def _plan(request, *, as_json: bool, db=None, say_unread: bool = True, store: bool = True, reuse: bool = True,
          save: bool = True, spec=None):
    """``planner.usecases.plan_request`` with the device's active calibration; a store that
    cannot be read is said on stderr when ``say_unread`` (else saving the plan reports it).
    ``store=False``: plan only. ``spec``: the model already resolved (else ``request.model`` is)."""
    from planner.calibration.lookup import active_calibration
    from planner.cli._common import print_json
    from planner.errors import NothingFitsError
    from planner.store.interface import open_plan_store
    from planner.usecases import plan_request

    calibration, note = active_calibration(request.gpu, db=db)
    if note and say_unread:
        console_to_stderr().print(note)
    try:
        return plan_request(request, store=(lambda: open_plan_store(url=db)) if store else None, spec=spec,
                            calibration=calibration, reuse=reuse, save=save)
    except NothingFitsError as exc:
        if as_json and exc.result is not None:
            # scripts get the request and every family's closest try; the error line still goes
            # to stderr and the exit code stays 3
            print_json(exc.result.to_dict() | {"plan_id": None, "error": str(exc)})
        raise


def _longest_contexts(planned) -> list:
    """``planner.solve.longest_seq_len`` of each plan shown, in rank order."""
    from planner.solve import longest_seq_len

    return [longest_seq_len(spec=planned.spec, gpu=planned.device, config=plan.config) for plan in planned.result.plans]


def _print_longest_contexts(out, plans, solved) -> None:
    from rich.table import Table

    from planner.solve import eval_tokens_past_seq_len

    from planner.units import format_bytes

    table = Table(title="the longest sequence each plan fits (micro-batch as planned)")
    for col in ("#", "fits", "process total", "not near the edge", "process total"):
        table.add_column(col, justify="right")
    for plan, s in zip(plans, solved):
        # the limit is the model's positions, times the RoPE scaling where the plan has one (config.context_limit),
        # less the tokens the eval pass generates past a prompt of the training length (solve.longest_seq_len)
        at_limit = " (the RoPE-scaled maximum" if plan.config.rope_scaling else " (the model's maximum"
        generated = eval_tokens_past_seq_len(plan.config)
        at_limit += f" less the {generated:,} tokens the eval pass generates)" if generated else ")"
        table.add_row(str(plan.rank), f"{s.fits:,}" + (at_limit if s.fits == s.limit else ""),
                      format_bytes(s.fits_total) if s.fits_total else "-", f"{s.safe:,}" if s.safe else "none",
                      format_bytes(s.safe_total) if s.safe_total else "-")
    out.print(table)
    out.print("not near the edge: at most 5% chance of running out of memory (the model's measured error); train "
              "with that one", soft_wrap=True)


def _save_and_print(out, outcome, *, save: bool, no_offload: bool, print_table: bool, print_json_plan: bool,
                    extra: dict | None = None) -> str | None:
    """Print the plan the use case stored (stored first: a reader that stops early, | head, loses
    no plan); a store that failed still lets the table print first, then the error (without
    --no-save) or a note (with it). ``extra``: more keys of the --json answer."""
    from planner.cli._common import print_json
    from planner.cli.store import SavedPlan, report_saved

    planned, result = outcome.planned, outcome.planned.result
    if print_table:
        from planner.cli.suggest_view import print_suggestion

        print_suggestion(out, result, spec=planned.spec, device=planned.device, seq_defaulted=planned.seq_defaulted,
                         host=planned.host_bytes, no_offload=no_offload, host_source=planned.host_source)
    if outcome.store_error is not None:
        if save:
            raise outcome.store_error
        saved = SavedPlan(plan_id=None, existing=None, note=f"note: past plans not checked: {outcome.store_error}")
    else:
        saved = SavedPlan(plan_id=outcome.plan_id, existing=outcome.existing)
    plan_id = report_saved(saved, console=out)
    if print_json_plan:
        print_json(result.to_dict() | {"plan_id": plan_id} | (extra or {}))
    return plan_id


def _answer_from_store(out, plan, *, device, as_json: bool) -> None:
    from planner.answers import answer_position, from_store_dict
    from planner.cli._common import print_json
    from planner.cli.verify_view import print_verified

    if as_json:
        print_json(from_store_dict(plan))
        return
    when = plan.status_changed_at.strftime("%Y-%m-%d %H:%M UTC") if plan.status_changed_at else plan.created_at.strftime("%Y-%m-%d %H:%M UTC")
    out.print(f"answered from the store: plan {plan.id} for this request was verified {when} "
              "(--fresh plans and verifies again)")
    print_verified(out, plan, answer=answer_position(plan), device_is_cpu=device.is_cpu)
    out.print(f"plan id: {plan.id}")


def _adopt(plan_id: str, *, planned, db) -> str:
    """The stored plan ``--plan-id`` names: it must be this same request (``PlanRequest.identity()``)."""
    from planner.errors import StoreError
    from planner.store.interface import open_plan_store

    with open_plan_store(url=db) as store:
        plan = store.get_plan(plan_id=plan_id)
    theirs = plan.request
    if planned.result.request.identity() != theirs.identity():
        raise StoreError(f"plan {plan.id[:8]} was made for another request ({theirs.model_id} on {theirs.gpu_count} x "
                         f"{theirs.gpu}, batch {theirs.target_batch}): run suggest with its options, or without --plan-id")
    return plan.id


def _verify(out, plan_id: str | None, *, planned, db, options, as_json: bool) -> None:
    """Verify the stored plan on Ray (``planner.usecases.verify_stored_plan``), show progress,
    then measured vs predicted and the answer; exit 1 when no candidate fit when run."""
    from planner.cli.verify_view import verify_and_show
    from planner.store import PlanStatus
    from planner.store.interface import open_plan_store

    assert plan_id is not None
    with open_plan_store(url=db) as store:
        plan = verify_and_show(out, store=store, plan_id=plan_id, options=options, as_json=as_json, spec=planned.spec)
    if plan.status is not PlanStatus.VERIFIED:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("suggest")(suggest)
