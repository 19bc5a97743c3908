"""POST /v1/plans speed: requests per second and p50/p99 latency for 200 requests from 8 clients.

    python bench/api_speed.py                      # starts 'planner serve' on a temporary SQLite store
    python bench/api_speed.py --workers 2          # one server process per core
    python bench/api_speed.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/api_speed.py --url http://127.0.0.1:8000 [--token T]   # an already running server

Each request is a whole ``planner suggest`` (Llama-2-7b on an A10G, batch 32) plus storing the
plan; the figures are for this machine and its load at the time, a benchmark, not a test.
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

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "meta-llama/Llama-2-7b-hf", "gpu": "a10g", "target_batch": 32}


@contextlib.contextmanager
def local_server(db: str | None, *, workers: int) -> Iterator[str]:
    """``python -m planner serve`` on a free port of 127.0.0.1, stopped (by its pid) at the end."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="api-speed-") as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        env = os.environ | {"PYTHONPATH": str(ROOT), "PLANNER_DATABASE_URL": db or f"sqlite:///{tmp}/bench.db"}
        env.pop("PLANNER_API_TOKEN", None)
        proc = subprocess.Popen([sys.executable, "-m", "planner", "serve", "--port", str(port), "--workers", str(workers),
                                 "--log-level", "warning"],
                                env=env, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                if proc.poll() is not None:
                    raise SystemExit(f"planner serve exited with {proc.returncode}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)
            else:
                raise SystemExit("planner serve did not answer /healthz in 60 s")
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


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
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--db", help="database URL for the server this script starts (default: a temporary SQLite file)")
    parser.add_argument("--token", default=os.environ.get("PLANNER_API_TOKEN"), help="bearer token of --url")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1, help="server processes of the server this script starts")
    args = parser.parse_args()
    if args.url:
        run(args.url, requests=args.requests, clients=args.clients, token=args.token)
        return
    with local_server(args.db, workers=args.workers) as url:
        print(f"planner serve --workers {args.workers}")
        run(url, requests=args.requests, clients=args.clients, token=None)


if __name__ == "__main__":
    main()
