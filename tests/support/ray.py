"""A Ray head of the tests' own (``ray start --head`` with the job API on 127.0.0.1) and a tiny model config."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

TINY = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 256,
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_the_job_agent(client, *, deadline: float) -> None:
    """The job API answers before the node's job agent has registered; until it has, a submission
    is refused with 500 "No available agent to submit job" (ray/dashboard/modules/job/job_head.py
    ``submit_job``), which a loaded machine makes last tens of seconds. Submit a no-op job until
    one is accepted, and let it end, so that the test's own submission meets a ready cluster."""
    while True:
        try:
            job = client.submit_job(entrypoint="python -c pass")
            break
        except Exception as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)
    while not client.get_job_status(job).is_terminal() and time.monotonic() < deadline:
        time.sleep(1)


@pytest.fixture
def ray_head():
    """``ray start --head`` with the dashboard (the job API) on 127.0.0.1, in a process group of
    its own that the test stops by its pid: nothing else's Ray is touched."""
    import shutil
    import subprocess
    import tempfile

    pytest.importorskip("ray.dashboard")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # unix socket paths must stay short
    dashboard = _free_port()
    import sys

    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus", "2", "--port", str(_free_port()),
           "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
           "--ray-client-server-port", str(_free_port()), "--dashboard-agent-listen-port", str(_free_port()),
           "--temp-dir", temp]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(os.path.join(temp, "head.log"), "wb")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        from planner.verify.jobs import job_client

        deadline = time.monotonic() + 120
        while True:
            try:
                job_client(address).list_jobs()
                break
            except Exception:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(open(os.path.join(temp, "head.log")).read()[-3000:])
                time.sleep(1)
        _wait_for_the_job_agent(job_client(address), deadline=deadline + 120)
        yield address
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        try:  # what ray start spawned shares its process group
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
