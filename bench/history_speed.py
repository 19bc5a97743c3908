"""History reads at 100,000 plans: ``GET /v1/plans`` latency for pages near the start, deep in
the store (past offset 65,535, where an id list would pass the drivers' bind-parameter limit) and
by cursor, and ``planner history -n 100000`` as one store call.

    python bench/history_speed.py                                  # a temporary SQLite file
    python bench/history_speed.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
                                                                   # a temporary schema there, dropped after

The store is filled in bulk with the plan rows ``save_plan`` writes (tests/store/test_store_paging.py's
``bulk_plan_rows``, no candidates) and served by ``planner serve`` (bench/api_speed.py's
``local_server``); each figure is the median and the slowest of ``--repeat`` requests, one client.
A benchmark for this machine and its load at the time, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

PLANS = 100_000


@contextlib.contextmanager
def database(postgres: str | None) -> Iterator[str]:
    """A URL of an empty database: a temporary SQLite file, or a fresh schema on ``postgres``."""
    if postgres is None:
        with tempfile.TemporaryDirectory(prefix="history-speed-") as tmp:
            yield f"sqlite:///{tmp}/bench.db"
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    schema = f"history_speed_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield make_url(postgres).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def fill(url: str, plans: int) -> float:
    from sqlalchemy import insert
    from test_store_paging import bulk_plan_rows

    from planner.store import open_store
    from planner.store.dbmodels import PlanRequestRow

    start = time.perf_counter()
    rows = bulk_plan_rows(plans)
    with open_store(url=url) as store, store.session_scope(write=True) as session:
        for first in range(0, plans, 10_000):
            session.execute(insert(PlanRequestRow), rows[first:first + 10_000])
    return time.perf_counter() - start


def timed(fn, repeat: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", help="a PostgreSQL URL to make a temporary schema on (default: SQLite)")
    parser.add_argument("--plans", type=int, default=PLANS)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    import httpx
    from api_speed import local_server

    from planner.store import open_store

    with database(args.postgres) as url:
        print(f"{args.plans:,} plans stored in {fill(url, args.plans):.1f} s on "
              f"{'PostgreSQL' if args.postgres else 'SQLite'}")
        with local_server(url, workers=1) as server, httpx.Client(base_url=server, timeout=120) as client:
            def get(**params):
                def call() -> None:
                    answer = client.get("/v1/plans", params=params)
                    answer.raise_for_status()
                return call

            cursor = client.get("/v1/plans", params={"offset": 99_000, "limit": 500}).json()["next_cursor"]
            cases = [("offset 0, limit 20", get(limit=20)), ("offset 0, limit 500", get(limit=500)),
                     ("offset 65,035, limit 500", get(offset=65_035, limit=500)),
                     ("offset 99,000, limit 500", get(offset=99_000, limit=500)),
                     ("after the cursor at 99,500, limit 500", get(after=cursor, limit=500)),
                     ("model filter, offset 9,000, limit 20", get(model="model-3", offset=9_000, limit=20))]
            for name, call in cases:
                median, worst = timed(call, args.repeat)
                print(f"  GET /v1/plans {name:<40} p50 {median * 1000:7.1f} ms, max {worst * 1000:7.1f} ms")
        with open_store(url=url) as store:
            median, worst = timed(lambda: store.history(limit=min(args.plans, 100_000)), max(3, args.repeat // 5))
        print(f"  planner history -n 100000 (the store call)          p50 {median * 1000:7.1f} ms, "
              f"max {worst * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
