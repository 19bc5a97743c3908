"""POST /v1/plans speed: requests per second and p50/p99 latency for 200 requests from 8 clients;
then a fault scenario: the same service under load while one of its workers is killed, its
database connections are terminated and its database hangs for 10 s.

    python bench/api_speed.py                      # starts 'planner serve' on a temporary SQLite store
    python bench/api_speed.py --workers 2          # one server process per core
    python bench/api_speed.py --db postgresql+psycopg://postgres@127.0.0.1:5432/bench   # a database of its own
    python bench/api_speed.py --url http://127.0.0.1:8000 [--token T]   # an already running server (speed only)
    python bench/api_speed.py --faults-only --db ...                    # the fault scenario alone

Each request is a whole ``planner suggest`` (Llama-2-7b on an A10G, batch 32) plus storing the
plan; the figures are for this machine and its load at the time, a benchmark, not a test.

The fault scenario (``planner serve --workers 2``, 8 clients sending plans and reads for 35 s):
at 5 s one worker is killed (SIGKILL; uvicorn starts another), at 12 s every database connection
is terminated (PostgreSQL: pg_terminate_backend of the service's backends), from 18 s to 28 s
the database hangs (PostgreSQL: a proxy in front of it stops relaying and leaves new connections
unanswered; SQLite: another process holds the write lock). It prints the requests answered, the
5xx answers (503: the database's state said; 500: none expected), the requests the killed worker
took down with it, and the rows lost: plans answered 201 that the store does not hold (0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "meta-llama/Llama-2-7b-hf", "gpu": "a10g", "target_batch": 32}


@contextlib.contextmanager
def local_server(db: str, *, workers: int, procs: list | None = None) -> Iterator[str]:
    """``python -m planner serve`` on a free port of 127.0.0.1, stopped (by its pid) at the end;
    ``procs`` receives its Popen."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {"PYTHONPATH": str(ROOT), "PLANNER_DATABASE_URL": db}
    env.pop("PLANNER_API_TOKEN", None)
    env.pop("PLANNER_API_READ_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "planner", "serve", "--port", str(port), "--workers", str(workers),
                             "--log-level", "warning"], env=env, cwd=ROOT)
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise SystemExit(f"planner serve exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise SystemExit("planner serve did not answer /healthz in 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(url: str, *, requests: int, clients: int, token: str | None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, timeout=300, headers=headers, limits=httpx.Limits(max_connections=clients)) as client:
        client.post("/v1/plans", json=BODY).raise_for_status()  # warm-up: imports and caches in the server

        def one(_: int) -> tuple[float, int]:
            start = time.perf_counter()
            status = client.post("/v1/plans", json=BODY).status_code
            return time.perf_counter() - start, status

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(one, range(requests)))
        wall = time.perf_counter() - start
    latencies = sorted(t for t, _ in results)
    failed = sum(status != 201 for _, status in results)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * len(latencies)) - 1)]
    print(f"POST /v1/plans: {requests} requests from {clients} clients in {wall:.2f} s on {os.cpu_count()} CPUs")
    print(f"  {requests / wall:.1f} requests/s; latency p50 {statistics.median(latencies) * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms; {failed} not 201")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one); the fault scenario needs its own")
    parser.add_argument("--db", help="database URL for the server this script starts (default: a temporary SQLite "
                                     "file); the fault scenario terminates this database's connections to it")
    parser.add_argument("--token", default=os.environ.get("PLANNER_API_TOKEN"), help="bearer token of --url")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1, help="server processes of the server this script starts")
    parser.add_argument("--no-faults", action="store_true", help="the speed run only")
    parser.add_argument("--faults-only", action="store_true", help="the fault scenario only")
    args = parser.parse_args()
    if args.url:
        run(args.url, requests=args.requests, clients=args.clients, token=args.token)
        return
    with tempfile.TemporaryDirectory(prefix="api-speed-") as tmp:
        db = args.db or f"sqlite:///{tmp}/bench.db"
        if not args.faults_only:
            with local_server(db, workers=args.workers) as url:
                print(f"planner serve --workers {args.workers}")
                run(url, requests=args.requests, clients=args.clients, token=None)
        if not args.no_faults:
            from faults import fault_scenario

            fault_scenario(db, clients=args.clients, server=local_server)


if __name__ == "__main__":
    main()
