"""Planning runs as Ray jobs: ``planner submit`` and ``planner jobs``, over Ray's
``JobSubmissionClient`` (the dashboard's job API, ``http://HEAD:8265``).

A submitted job's entrypoint is ``planner suggest <the request> --verify --plan-id ID``: the plan
is made and stored here first (so bad input fails here, before anything is sent, and the plan id
is known at once), and the job's driver verifies that stored plan on the cluster, writing to the
database named in its runtime environment (``PLANNER_DATABASE_URL`` and the other ``PLANNER_*``
settings of this process). ``ray job submit --address … -- planner suggest … --verify`` by hand
works too: the driver then plans and stores the plan itself, with the job id
(``planner.verify.driver.current_job_id``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ClusterUnavailableError, JobNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from planner.planning import SuggestRequest

#: The job API's address when neither --address nor RAY_ADDRESS (an http one) gives it
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: Metadata key of the plan a submitted job verifies
PLAN_ID_KEY = "planner_plan_id"


@dataclass(frozen=True, kw_only=True)
class Submission:
    """What ``submit_verification`` sent."""

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


def _model_argument(request: "SuggestRequest") -> tuple[str, str | None]:
    """(the --model to send, a folder to upload as the job's working_dir). A config.json on this
    disk travels with the job: the cluster cannot read this machine's files."""
    path = Path(request.model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        return request.model, None  # a catalog id or an HF cache id: resolved on the cluster
    folder = tempfile.mkdtemp(prefix="planner-job-")
    shutil.copyfile(config, Path(folder) / "config.json")
    return "config.json", folder


def submission_env(database_url: str) -> dict[str, str]:
    """The job's environment: the database it writes to and this process's PLANNER_* settings."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PLANNER_")}
    env["PLANNER_DATABASE_URL"] = database_url
    env["HF_HUB_OFFLINE"] = "1"
    return env


def submit_verification(*, request: "SuggestRequest", address: str, database_url: str | None = None,
                        verify_top: int = 3, steps: int = 3, run_timeout_s: float = 900.0) -> Submission:
    """Plan ``request`` here, store it, and submit its verification as a Ray job. Bad input and
    "nothing fits" raise here; an unreachable job API raises before anything is stored."""
    from dataclasses import replace

    from planner.planning import make_plan
    from planner.store import PlanStatus, default_database_url, open_store
    from planner.verify.driver import VerifyOptions

    VerifyOptions(top=verify_top, steps=steps, timeout_s=run_timeout_s)  # validate before anything runs
    address = job_address(address)
    from planner.calibration.lookup import active_calibration

    planned = make_plan(request, calibration=active_calibration(request.gpu, db=database_url)[0])
    # what this machine defaulted (host RAM for offload; the cpu profile's memory) is pinned, so
    # the job's driver, on another machine, makes the very same request
    request = replace(request, cpu_mem_bytes=planned.host_bytes,
                      gpu_mem_bytes=planned.device.memory_bytes if planned.device.is_cpu else request.gpu_mem_bytes)
    client = job_client(address)
    url = database_url or default_database_url()
    model_arg, working_dir = _model_argument(request)
    args = ["planner", "suggest", *replace(request, model=model_arg).to_cli_args(), "--verify", "--verify-top",
            str(verify_top), "--steps", str(steps), "--run-timeout", f"{run_timeout_s:g}"]
    with open_store(url=url) as store:
        plan_id = store.save_plan(result=planned.result)
        entrypoint = shlex.join([*args, "--plan-id", plan_id])
        runtime_env: dict[str, Any] = {"env_vars": submission_env(url)}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        try:
            job_id = _call("submit", plan_id, lambda: client.submit_job(
                entrypoint=entrypoint, runtime_env=runtime_env, metadata={PLAN_ID_KEY: plan_id},
                submission_id=f"planner-{plan_id[:12]}-{uuid.uuid4().hex[:6]}"))
        except ClusterUnavailableError as exc:
            store.set_status(plan_id=plan_id, status=PlanStatus.FAILED, reason=f"not submitted: {exc}")
            raise
        finally:
            if working_dir:
                shutil.rmtree(working_dir, ignore_errors=True)
        store.set_status(plan_id=plan_id, status=PlanStatus.PLANNED, ray_job_id=job_id,
                         reason=f"submitted as Ray job {job_id} to {address}")
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


__all__ = ["DEFAULT_ADDRESS", "PLAN_ID_KEY", "Submission", "job_address", "job_client", "job_info", "job_logs",
           "list_jobs", "stop_job", "submission_env", "submit_verification", "wait_for_job"]
