"""Issue 12 item 3: a killed ``planner measure`` leaves no training child and no job directory.

``planner measure`` runs as a real subprocess (``python -m planner measure`` of a tiny llama on the
CPU, with enough steps to run for minutes); once its child ``python -m workers.child`` is
training, the parent is killed with SIGKILL or SIGTERM. The child must be gone within seconds
and the temporary directory (``TMPDIR`` is the test's own) must hold no ``workers-job-*``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from workers.runner import JOB_DIR_PREFIX, run_job, sweep_orphaned_job_dirs  # noqa: E402

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}


def _children(pid: int) -> list[int]:
    """Live (not zombie) measurement processes (``python -m workers.child``) whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and _is_measurement_child(int(entry.name)):
            found.append(int(entry.name))
    return found


def _is_measurement_child(pid: int) -> bool:
    try:
        return "workers.child" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


def _training(pid: int) -> bool:
    """The child has loaded libtorch: it is past its start and into the run."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_planner_measure_kills_its_child_and_leaks_no_job_dir(tmp_path, sig):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir))
    parent = subprocess.Popen(
        [sys.executable, "-m", "planner", "measure", "-m", str(config), "--gpu", "cpu", "--steps", "1000000",
         "--timeout", "3600", "--no-save"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    child = None
    try:
        child = _wait(lambda: _children(parent.pid), 120, "the measurement child")[0]
        assert [p.name for p in tmpdir.iterdir() if p.name.startswith(JOB_DIR_PREFIX)]
        _wait(lambda: _training(child), 120, "the child to load torch")
        time.sleep(0.5)
        os.kill(parent.pid, sig)
        assert parent.wait(30) == -sig
        _wait(lambda: not _alive(child), 15, f"the orphaned child {child} to die")
        _wait(lambda: not any(p.name.startswith(JOB_DIR_PREFIX) for p in tmpdir.iterdir()), 15, "the job dir to go")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):  # a failed test must not leave a run behind
            os.kill(child, signal.SIGKILL)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_run_sweeps_job_dirs_whose_owner_is_dead(tmp_path):
    dead = tmp_path / f"{JOB_DIR_PREFIX}{_dead_pid()}-abc123"
    live = tmp_path / f"{JOB_DIR_PREFIX}{os.getpid()}-def456"
    legacy = tmp_path / f"{JOB_DIR_PREFIX}12345678"  # old naming without an owner: not ours to judge
    for d in (dead, live, legacy):
        d.mkdir()
        (d / "child.log").write_text("x")
    assert sweep_orphaned_job_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and legacy.exists()


def test_a_child_whose_parent_died_before_it_started_exits_at_once(tmp_path):
    """The race prctl alone leaves open: the expected parent is not our parent any more."""
    job_dir = tmp_path / f"{JOB_DIR_PREFIX}1-x"
    job_dir.mkdir()
    env = dict(os.environ, WORKERS_PARENT_PID=str(_dead_pid()), WORKERS_JOB_DIR=str(job_dir))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "workers.child"], input=b"{}", env=env, timeout=60,
                          start_new_session=True)
    assert proc.returncode == -signal.SIGKILL
    assert not job_dir.exists() and time.monotonic() - t0 < 60


def test_a_sigterm_to_the_child_while_its_parent_lives_is_still_reported_as_sigterm():
    import threading

    def term_child():
        me = os.getpid()
        child = _wait(lambda: _children(me), 30, "the child")[0]
        time.sleep(1.0)  # past its start-up, into the hang
        os.kill(child, signal.SIGTERM)

    killer = threading.Thread(target=term_child)
    killer.start()
    m, details = run_job({"model_config": TINY, "config": {}, "device": "cpu", "steps": 2, "fault": "hang"}, timeout_s=60)
    killer.join()
    assert "killed by SIGTERM" in m.error and not details["timed_out"]


def test_an_orphaned_child_removes_only_a_job_directory(tmp_path):
    precious = tmp_path / "not-a-job-dir"
    precious.mkdir()
    env = dict(os.environ, WORKERS_PARENT_PID=str(_dead_pid()), WORKERS_JOB_DIR=str(precious))
    proc = subprocess.run([sys.executable, "-m", "workers.child"], input=b"{}", env=env, timeout=60, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL and precious.exists()
