"""Verification runs as Ray jobs: ``planner submit`` and ``planner jobs``, over Ray's
``JobSubmissionClient`` (the dashboard's job API, ``http://HEAD:8265``).

A submitted job verifies a STORED plan: the plan is made and stored here first
(``planner.usecases.plan_request``: bad input fails here, before anything is sent, and the plan id
is known at once), and the job's entrypoint is ``planner jobs verify PLAN_ID --model MODEL …``:
its driver loads the plan's candidates from the store and verifies them
(``planner.usecases.verify_stored_plan``); nothing is planned again on the cluster. ``ray job
submit --address … -- planner suggest … --verify`` by hand works too: the driver then plans and
stores the plan itself, with the job id (``planner.verify.driver.current_job_id``).

What a job carries is not secret. Ray stores a job's entrypoint, runtime environment and
metadata with the job, returns them to anyone who reaches the dashboard's job API
(``GET /api/jobs/``), and hands the runtime environment's variables to every worker process of
the job. So:

* the runtime environment's variables are an allow-list (``FORWARDED_ENV``: the database
  timeouts, ``HF_HUB_OFFLINE``), never this process's ``PLANNER_*`` settings (the API's tokens);
* the driver is told its database by reference (``job_database``): the path of a file holding
  the URL (``PLANNER_DATABASE_URL_FILE``, a secret mounted on the head at the same path, as
  docker-compose.yml does) or, for a URL that holds no credential (a SQLite file, PostgreSQL
  with trust, peer or a ~/.pgpass on the head), ``--db URL`` on the entrypoint, which only the
  driver's process sees. A URL with a password and no file is refused before anything is stored.
* only the driver, on the head, opens the database: runs hand their measurements back to it as
  task results (``planner.verify.runs``), and run processes get no database setting at all.

Why this and not results returned to the submitter: ``planner submit`` and the service answer at
once and may be gone when the runs end (a laptop closed, a server restarted), and the driver
renews the plan's lease while it runs; the driver writing the store itself keeps a verification
whole without a client that waits. A per-job database role would need PostgreSQL-only row
security for SQLite's single file.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ClusterUnavailableError, JobNotFoundError, StatusTransitionError, StoreError
from planner.store.deadlines import TIMEOUT_ENVS
from planner.verify.driver import VerifyOptions

if TYPE_CHECKING:  # pragma: no cover
    from planner.results import PlanResult
    from planner.store import PlanStore

#: The job API's address when neither --address nor RAY_ADDRESS (an http one) gives it
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: Metadata key of the plan a submitted job verifies
PLAN_ID_KEY = "planner_plan_id"


@dataclass(frozen=True, kw_only=True)
class Submission:
    """What ``submit_plan`` sent."""

    plan_id: str
    job_id: str
    address: str
    entrypoint: str


def job_address(address: str | None) -> str:
    """``--address``, else ``RAY_ADDRESS`` when it is a dashboard URL, else the local default."""
    if address:
        return address if "://" in address else f"http://{address}"
    env = os.environ.get("RAY_ADDRESS", "")
    return env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS


def auth_headers() -> dict[str, str]:
    """The cluster's token as a bearer header, found where Ray's own CLI looks
    (``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``); empty when
    there is none. Ray 2.5x+ clusters started with ``ray start`` require it by default
    (https://docs.ray.io/en/latest/ray-security/token-auth.html), and the SDK only sends it by
    itself when ``RAY_AUTH_MODE=token`` is set."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        try:
            token = path.read_text().strip()
        except OSError:
            token = ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def job_client(address: str) -> Any:
    """A ``JobSubmissionClient``; one line when the job API does not answer."""
    from planner.verify.cluster import import_ray

    import_ray()
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=auth_headers())
    except Exception as exc:  # requests' and Ray's connection errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterUnavailableError(
            f"cannot reach the Ray job API at {address}: {first[:300]}; start the head with "
            "'ray start --head --dashboard-host 0.0.0.0' or check --address"
        ) from None


def _call(what: str, job_id: str, fn: Any, *args: Any) -> Any:
    """A client call; an unknown job id is ``JobNotFoundError``, other failures one line."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        text = str(exc)
        if "does not exist" in text or "404" in text:
            raise JobNotFoundError(f"no Ray job {job_id!r} on this cluster: see 'planner jobs list'") from None
        raise ClusterUnavailableError(f"cannot {what} job {job_id}: {text.strip().splitlines()[0][:300]}") from None


def _model_argument(model: str, *, local_files: bool) -> tuple[str, str | None]:
    """(the --model to send, a folder to upload as the job's working_dir). A catalog id is sent
    as is, whatever this disk holds under that name (``resolve_model`` takes the catalog first, so
    the cluster plans the model planned here); a config.json on this disk travels with the job (the
    cluster cannot read this machine's files), unless ``local_files`` is False (the service: it
    never reads its own disk for a model)."""
    from planner.catalog import catalog_source
    from planner.errors import UnknownModelError

    try:
        catalog_source(model)
        return model, None
    except UnknownModelError:
        if not local_files:
            raise UnknownModelError(f"model {model!r} is not a catalog id (GET /v1/models lists them): "
                                    "a verification job resolves the model by its catalog id") from None
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        return model, None  # a catalog id or an HF cache id: resolved on the cluster
    folder = tempfile.mkdtemp(prefix="planner-job-")
    shutil.copyfile(config, Path(folder) / "config.json")
    return "config.json", folder


#: The variables a job's runtime environment carries from this process, when set here: none is
#: a secret (Ray stores them with the job and shows them; every worker of the job inherits them)
FORWARDED_ENV = tuple(TIMEOUT_ENVS.values())


def job_database(database_url: str, *, url_file: str | None) -> tuple[list[str], dict[str, str]]:
    """How the job's driver finds its database, as (entrypoint arguments, runtime environment
    variables), neither holding a credential: the path of a file on the head holding the URL when
    ``url_file`` is given, else the URL itself on the entrypoint when it holds no credential.
    ``StoreError`` (before anything is stored or sent) for a URL with a password and no file."""
    from planner.store.engine import DATABASE_URL_ENV, DATABASE_URL_FILE_ENV, url_has_credentials

    if url_file:
        # blank the head's own URL variable, if it has one: the file names the database the plan is in
        return [], {DATABASE_URL_FILE_ENV: url_file, DATABASE_URL_ENV: ""}
    if url_has_credentials(database_url):
        raise StoreError(
            f"the database URL holds a password, and a Ray job's settings are stored by Ray and shown by its job API: "
            f"put the URL in a file the cluster's head can read at the same path and set {DATABASE_URL_FILE_ENV} to it "
            f"(instead of {DATABASE_URL_ENV} or --db), or use a URL without a password (PostgreSQL reads a "
            "~/.pgpass on the head)")
    return ["--db", database_url], {}


def submission_env(*, database_env: dict[str, str] | None = None) -> dict[str, str]:
    """The job's runtime environment variables: the allow-list ``FORWARDED_ENV`` as set here, the
    database reference of ``job_database``, and no Hugging Face downloads."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name, "").strip()}
    env.update(database_env or {})
    env["HF_HUB_OFFLINE"] = "1"
    return env


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """Where and how a stored plan's verification job runs (``planner submit``, ``"verify": true``)."""

    address: str | None
    """The job API (``job_address``: --address, else an http ``RAY_ADDRESS``, else the local default)."""
    options: VerifyOptions = field(default_factory=VerifyOptions)
    """Candidates to verify, steps and timeout of each run (validated when made)."""
    database_url: str | None = None
    """The store the plan is written to here (default: ``default_database_url()``)."""
    database_url_file: str | None = None
    """The path, on the head, of a file holding that URL, which the job is given instead of it
    (default: ``$PLANNER_DATABASE_URL_FILE`` when ``database_url`` is not given)."""
    local_files: bool = True
    """False (the service): only catalog ids are sent, never a file of this disk."""


@dataclass(frozen=True, kw_only=True)
class JobReference:
    """How the job's driver finds the database (``job_database``), checked before anything is stored."""

    url: str
    args: tuple[str, ...]
    env: dict[str, str]


def job_reference(job: JobRequest) -> JobReference:
    """The job's database reference; ``StoreError`` for a URL with a password and no file."""
    from planner.store import default_database_url
    from planner.store.engine import DATABASE_URL_FILE_ENV

    url_file = job.database_url_file
    if job.database_url is None and url_file is None:
        url_file = os.environ.get(DATABASE_URL_FILE_ENV, "").strip() or None
    url = job.database_url or default_database_url()
    args, env = job_database(url, url_file=url_file)
    return JobReference(url=url, args=tuple(args), env=env)


def submit_plan(job: JobRequest, *, reference: JobReference, store: "PlanStore", result: "PlanResult",
                model: str) -> Submission:
    """Store ``result`` in ``store`` (the database ``reference`` names) and submit its
    verification as a Ray job whose driver verifies that stored plan by its id
    (``planner jobs verify``). An unreachable job API raises before anything is stored; a
    submission the API refuses leaves the plan ``failed`` with why. ``model``: as the request
    named it (a catalog id is sent as is, a config.json on this disk travels with the job)."""
    address = job_address(job.address)
    client = job_client(address)
    model_arg, working_dir = _model_argument(model, local_files=job.local_files)
    options = job.options
    try:
        plan_id = store.save_plan(result=result)
        entrypoint = shlex.join([
            "planner", "jobs", "verify", plan_id, "--model", model_arg, "--verify-top", str(options.top),
            "--steps", str(options.steps), "--run-timeout", f"{options.timeout_s:g}", *reference.args])
        runtime_env: dict[str, Any] = {"env_vars": submission_env(database_env=reference.env)}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        try:
            job_id = _call("submit", plan_id, lambda: client.submit_job(
                entrypoint=entrypoint, runtime_env=runtime_env, metadata={PLAN_ID_KEY: plan_id},
                submission_id=f"planner-{plan_id[:12]}-{uuid.uuid4().hex[:6]}"))
        except ClusterUnavailableError as exc:
            store.set_status(plan_id=plan_id, status="failed", reason=f"not submitted: {exc}")
            raise
    finally:
        if working_dir:
            shutil.rmtree(working_dir, ignore_errors=True)
    try:
        store.set_status(plan_id=plan_id, status="planned", ray_job_id=job_id,
                         reason=f"submitted as Ray job {job_id} to {address}")
    except StatusTransitionError:
        pass  # the job's driver got there first (verifying, or done): it noted its job id itself
    return Submission(plan_id=plan_id, job_id=job_id, address=address, entrypoint=entrypoint)


def list_jobs(*, address: str) -> list[Any]:
    """Every job the cluster knows (``JobDetails``), newest first."""
    client = job_client(job_address(address))
    jobs = _call("list", "*", client.list_jobs)
    return sorted(jobs, key=lambda j: j.start_time or 0, reverse=True)


def job_info(*, address: str, job_id: str) -> Any:
    """``JobDetails`` of one job (status: a ``JobStatus`` with ``is_terminal()``)."""
    client = job_client(job_address(address))
    return _call("look up", job_id, client.get_job_info, job_id)


def job_logs(*, address: str, job_id: str) -> str:
    client = job_client(job_address(address))
    return _call("read the logs of", job_id, client.get_job_logs, job_id)


def stop_job(*, address: str, job_id: str) -> bool:
    """Ask the job to stop (SIGTERM, then SIGKILL after Ray's grace period); False if it had ended."""
    client = job_client(job_address(address))
    return bool(_call("stop", job_id, client.stop_job, job_id))


def wait_for_job(*, address: str, job_id: str, timeout_s: float, poll_s: float = 1.0) -> Any:
    """Poll until the job's status is terminal (or ``timeout_s`` passed); returns its details."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(address=address, job_id=job_id)
        if info.status.is_terminal() or time.monotonic() >= deadline:
            return info
        time.sleep(poll_s)


__all__ = ["DEFAULT_ADDRESS", "FORWARDED_ENV", "PLAN_ID_KEY", "JobReference", "JobRequest", "Submission", "job_address",
           "job_client", "job_database", "job_info", "job_logs", "job_reference", "list_jobs", "stop_job",
           "submission_env", "submit_plan", "wait_for_job"]
