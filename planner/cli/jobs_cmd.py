"""``planner submit`` and ``planner jobs list|status|logs|stop``: planning runs as Ray jobs on a
cluster, through Ray's job submission API (``planner.verify.jobs``); ``planner jobs verify
PLAN_ID`` is what such a job runs: the stored plan's verification."""

from __future__ import annotations

from typing import Any, Optional

import typer

from planner.cli.plan import _GPU, _GPUS, _JSON, _MODEL, _SEQ, request_options
from planner.cli.suggest_cmd import (
    CPU_MEM,
    GPU_MEM,
    METHOD,
    NO_OFFLOAD,
    PRECISION,
    PREFER,
    RUN_TIMEOUT,
    STEPS,
    TARGET_BATCH,
    TOP_K,
    VERIFY_TOP,
)
from planner.request import RECIPE

_ADDRESS = typer.Option(None, "--address", help="The Ray job API, http://HEAD:8265 (default: $RAY_ADDRESS when it is http, else http://127.0.0.1:8265).")
_DB = typer.Option(None, "--db", help="Database URL the job writes to, without a password (default: PLANNER_DATABASE_URL, "
                   "the file PLANNER_DATABASE_URL_FILE names, which the job is given by path, or the local SQLite file).")


@request_options(RECIPE, after="prefer")
def submit(
    model: str = _MODEL,
    gpu: str = _GPU,
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
    verify: bool = typer.Option(True, "--verify/--no-verify", help="The job verifies the plan (it always does: the flag is accepted as suggest's)."),
    verify_top: int = VERIFY_TOP,
    steps: int = STEPS,
    run_timeout: float = RUN_TIMEOUT,
    address: Optional[str] = _ADDRESS,
    db: Optional[str] = _DB,
    as_json: bool = _JSON,
    **recipe: Any,
) -> None:
    """Plan here and submit the plan's verification to a Ray cluster as a job; prints the job id and the plan id."""
    from planner.calibration.lookup import active_calibration
    from planner.cli._common import console, print_json
    from planner.cli.suggest_cmd import _request
    from planner.errors import InvalidConfigError
    from planner.store import default_database_url
    from planner.store.interface import open_plan_store
    from planner.usecases import plan_request
    from planner.verify.driver import VerifyOptions
    from planner.verify.jobs import JobRequest

    if not verify:
        raise InvalidConfigError("planner submit sends a verification: to plan without one, run planner suggest")
    from planner.estimation import check_runs_installed

    check_runs_installed(recipe, command="planner submit's verification workers",
                         fix="plan that version with planner suggest --transformers ..., without a verification")
    if gpu.strip().lower() == "auto":
        raise InvalidConfigError("--gpu auto names the GPU of this machine, not of the cluster: name the GPU the job "
                                 "verifies on, e.g. --gpu a10g (see 'planner gpus')")
    request = _request(model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus, gpu_mem=gpu_mem,
                       method=method, precision=precision, no_offload=no_offload, cpu_mem=cpu_mem, top_k=top_k,
                       prefer=prefer,
                       recipe=recipe)
    import logging

    logging.getLogger("ray").setLevel(logging.WARNING)  # the SDK's INFO lines about uploading the config
    job = JobRequest(address=address, database_url=db,
                     options=VerifyOptions(top=verify_top, steps=steps, timeout_s=run_timeout))  # checked first
    url = db or default_database_url()
    # the use case suggest and the service call: plan, store, and submit the stored plan's verification
    sent = plan_request(request, store=lambda: open_plan_store(url=url), calibration=active_calibration(request.gpu, db=url)[0],
                        reuse=False, job=job).submission
    if as_json:
        print_json({"job_id": sent.job_id, "plan_id": sent.plan_id, "address": sent.address, "entrypoint": sent.entrypoint})
        return
    out = console()
    out.print(f"job id: {sent.job_id}", markup=False)
    out.print(f"plan id: {sent.plan_id}", markup=False)
    out.print(f"entrypoint: {sent.entrypoint}", markup=False)
    if url.startswith("sqlite") and not any(h in sent.address for h in ("127.0.0.1", "localhost")):
        out.print(f"note: the job writes to {url} on the cluster's head node; give --db a database both reach "
                  "(PostgreSQL) to see its result here", markup=False)
    out.print(f"follow it: planner jobs status {sent.job_id} --wait --address {sent.address}", markup=False)


def jobs_list(address: Optional[str] = _ADDRESS, as_json: bool = _JSON) -> None:
    """The cluster's jobs, newest first, with the plan each verifies."""
    from rich.table import Table

    from planner.cli._common import console, print_json
    from planner.verify.jobs import PLAN_ID_KEY, list_jobs

    jobs = list_jobs(address=address)
    if as_json:
        print_json([_job_dict(j) for j in jobs])
        return
    table = Table()
    for name in ("job id", "status", "plan id", "entrypoint"):
        table.add_column(name, no_wrap=name != "entrypoint")
    for job in jobs:
        table.add_row(job.submission_id or job.job_id or "-", str(job.status.value),
                      (job.metadata or {}).get(PLAN_ID_KEY, "-"), job.entrypoint or "")
    console().print(table if jobs else "no jobs on this cluster")


def _job_dict(job) -> dict:
    from planner.verify.jobs import PLAN_ID_KEY

    return {"job_id": job.submission_id or job.job_id, "status": str(job.status.value), "terminal": job.status.is_terminal(),
            "plan_id": (job.metadata or {}).get(PLAN_ID_KEY), "entrypoint": job.entrypoint, "message": job.message,
            "start_time": job.start_time, "end_time": job.end_time}


def jobs_status(
    job_id: str = typer.Argument(..., help="Job id (from planner submit or planner jobs list)."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job has ended."),
    timeout: float = typer.Option(3600, "--timeout", help="With --wait: give up after this many seconds (default: 3600)."),
    address: Optional[str] = _ADDRESS,
    db: Optional[str] = typer.Option(None, "--db", help="Database URL to look the plan up in (default: PLANNER_DATABASE_URL or the local SQLite file)."),
    as_json: bool = _JSON,
) -> None:
    """A job's status (and, when its plan is in the store, the plan's). Exit 1 when it ended other than SUCCEEDED."""
    from planner.cli._common import console, print_json
    from planner.verify.jobs import job_info, wait_for_job

    info = wait_for_job(address=address, job_id=job_id, timeout_s=timeout) if wait else job_info(address=address, job_id=job_id)
    data = _job_dict(info)
    plan = _stored_plan(data["plan_id"], db=db)
    if plan is not None:
        data["plan_status"], data["plan_status_reason"] = str(plan.status), plan.status_reason
    if as_json:
        print_json(data)
    else:
        out = console()
        out.print(f"job {data['job_id']}: {data['status']}" + (f" ({data['message']})" if data["message"] else ""), markup=False)
        if data["plan_id"]:
            out.print(f"plan {data['plan_id']}: " + (f"{plan.status}: {plan.status_reason or ''}" if plan else "not in this store"),
                      markup=False)
    if info.status.is_terminal() and str(info.status.value) != "SUCCEEDED":
        raise typer.Exit(1)


def _stored_plan(plan_id: str | None, *, db: str | None):
    from planner.errors import StoreError
    from planner.store import open_store

    if not plan_id:
        return None
    try:
        with open_store(url=db) as store:
            return store.get_plan(plan_id=plan_id)
    except StoreError:
        return None


def jobs_logs(job_id: str = typer.Argument(..., help="Job id."), address: Optional[str] = _ADDRESS) -> None:
    """Everything the job's driver printed so far."""
    from planner.cli._click import echo
    from planner.verify.jobs import job_logs

    echo(job_logs(address=address, job_id=job_id).rstrip("\n"))


def jobs_stop(job_id: str = typer.Argument(..., help="Job id."), address: Optional[str] = _ADDRESS) -> None:
    """Stop a running job (its plan is then marked failed when next read, once its lease runs out)."""
    from planner.cli._common import console
    from planner.verify.jobs import stop_job

    stopped = stop_job(address=address, job_id=job_id)
    console().print(f"job {job_id}: " + ("stop requested" if stopped else "had already ended"), markup=False)


def jobs_verify(
    plan_id: str = typer.Argument(..., help="The stored plan to verify (its id, or its first characters)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The model it was planned for: a catalog id or a config.json (default: the stored model id)."),
    verify_top: int = VERIFY_TOP,
    steps: int = STEPS,
    run_timeout: float = RUN_TIMEOUT,
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster to run on (default: $RAY_ADDRESS, which a job's driver has, else Ray embedded here)."),
    db: Optional[str] = typer.Option(None, "--db", help="Database URL (default: PLANNER_DATABASE_URL, the file PLANNER_DATABASE_URL_FILE names, or the local SQLite file)."),
    as_json: bool = _JSON,
) -> None:
    """Verify a stored plan by its id: its candidates, as stored, run for a few real steps on Ray.
    The entrypoint of the jobs 'planner submit' sends; exit 1 when no candidate fit when run."""
    from planner.cli._common import console, console_to_stderr
    from planner.cli.verify_view import verify_and_show
    from planner.store import PlanStatus
    from planner.store.interface import open_plan_store
    from planner.verify.cluster import import_ray
    from planner.verify.driver import VerifyOptions

    options = VerifyOptions(top=verify_top, steps=steps, timeout_s=run_timeout, address=ray_address)
    import_ray()
    out = console() if not as_json else console_to_stderr()
    with open_plan_store(url=db) as store:
        plan = verify_and_show(out, store=store, plan_id=plan_id, options=options, as_json=as_json, model=model,
                               header=f"verifying plan {plan_id}")
    if plan.status is not PlanStatus.VERIFIED:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("submit")(submit)
    jobs_app = typer.Typer(help="Planning jobs on a Ray cluster (Ray's job submission API).", no_args_is_help=True)
    jobs_app.command("list")(jobs_list)
    jobs_app.command("status")(jobs_status)
    jobs_app.command("logs")(jobs_logs)
    jobs_app.command("stop")(jobs_stop)
    jobs_app.command("verify", hidden=True)(jobs_verify)
    app.add_typer(jobs_app, name="jobs")
