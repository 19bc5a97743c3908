"""8 processes x 25 plans written at once to one SQLite file and to PostgreSQL: 200 stored, no error.

The processes also race to create the schema of the brand-new database on first use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.store import pg_url, sqlite_url  # noqa: F401 - fixtures

from planner.store import open_store

PROCESSES = 8
PLANS_EACH = 25

WORKER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[4])
from support.store import plan_result, request
from planner.store import open_store
url, worker, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
with open_store(url=url) as store:
    for i in range(%d):
        # a distinct target batch per plan says afterwards exactly which plan is missing, if any
        print(store.save_plan(result=plan_result(req=request(target_batch=1000 * worker + i + 1))), flush=True)
""" % PLANS_EACH


def run_writers(url: str, tmp_path: Path) -> list[str]:
    go = tmp_path / "go"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    tests_dir = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, url, str(w), str(go), tests_dir],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for w in range(PROCESSES)
    ]
    for p in procs:  # all imported and waiting: then release them together
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    started = time.monotonic()
    go.touch()
    outputs = [p.communicate(timeout=300) for p in procs]
    elapsed = time.monotonic() - started
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and err == "", err
    print(f"{PROCESSES} x {PLANS_EACH} plans to {url.split(':')[0]} in {elapsed:.2f} s")
    return [line for out, _ in outputs for line in out.split()]


def check_all_stored(url: str, ids: list[str]) -> None:
    assert len(ids) == len(set(ids)) == PROCESSES * PLANS_EACH
    with open_store(url=url) as store:
        assert store.count_plans() == PROCESSES * PLANS_EACH
        rows = store.history(limit=10 * PROCESSES * PLANS_EACH)
        assert {r.id for r in rows} == set(ids)
        expected = {1000 * w + i + 1 for w in range(PROCESSES) for i in range(PLANS_EACH)}
        assert {r.target_batch for r in rows} == expected
        assert all(r.candidates == 3 for r in rows)  # each plan whole, never half-written


@pytest.mark.slow
def test_concurrent_writers_sqlite(sqlite_url, tmp_path):
    check_all_stored(sqlite_url, run_writers(sqlite_url, tmp_path))


@pytest.mark.slow
@pytest.mark.postgres
def test_concurrent_writers_postgresql(pg_url, tmp_path):
    check_all_stored(pg_url, run_writers(pg_url, tmp_path))
