"""Shared pieces of the store tests: hand-made plans and one fresh database per test.

The plans are built here by hand (not by the search or estimate modules, which change on their
own schedule) with made-up but self-consistent numbers: every breakdown sums to its peak.
PostgreSQL tests get a schema of their own on the server at 127.0.0.1:5432 (database ``test``)
and skip with the reason when it is absent, unless PLANNER_REQUIRE_POSTGRES=1 (CI) makes that a
failure.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid

import pytest

from planner.config import TrainConfig
from planner.results import (
    Candidate,
    Measurement,
    MemoryEstimate,
    PlanRequest,
    PlanResult,
    Rejection,
    ThroughputEstimate,
)

PG_SERVER_URL = os.environ.get("PLANNER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MiB = 1024**2
#: Llama-3-8B: 8,030,261,248 parameters (its config.json: 32 layers, hidden 4096, vocab 128256).
LLAMA3_8B_PARAMS = 8_030_261_248
#: LoRA r16 on every linear of its 32 layers: r*(in+out) per matrix, summed over
#: q(4096->4096) k,v(4096->1024) o(4096->4096) gate,up(4096->14336) down(14336->4096):
#: 16*[(8192)+(5120)*2+(8192)+(18432)*3] = 16*81920 = 1,310,720 per layer, x32 = 41,943,040.
LORA_R16_PARAMS = 41_943_040


def memory(*, activations: int, lora: bool = True) -> MemoryEstimate:
    """bf16 frozen weights + fp32 LoRA weights, grads and two AdamW states + activations."""
    weights = LLAMA3_8B_PARAMS * 2
    trainable = LORA_R16_PARAMS * 4 if lora else 0
    breakdown = {
        "weights": weights,
        "trainable_weights": trainable,
        "gradients": trainable,
        "optimizer_states": 2 * trainable,
        "activations": activations,
    }
    allocated = sum(breakdown.values())
    reserved = allocated + 512 * MiB
    return MemoryEstimate(
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        process_total_bytes=reserved + 400 * MiB,
        cpu_bytes=0,
        breakdown=breakdown,
        peak_phase="backward",
        assumptions=("made-up activation figure for the store tests",),
    )


def candidate(*, rank: int | None, micro_batch: int, grad_accum: int, fits: bool = True) -> Candidate:
    config = TrainConfig(method="lora", precision="bf16-mixed", micro_batch=micro_batch, grad_accum=grad_accum,
                         seq_len=1024, grad_ckpt=True)
    step_s = 0.9 * micro_batch * grad_accum
    return Candidate(
        config=config,
        memory=memory(activations=micro_batch * 700 * MiB),
        throughput=ThroughputEstimate(
            step_s=step_s,
            tokens_per_s=micro_batch * grad_accum * 1024 / step_s,
            flops_per_step=6.0 * LLAMA3_8B_PARAMS * micro_batch * grad_accum * 1024,
            breakdown_s={"compute": step_s * 0.75, "recompute": step_s * 0.25},
        ),
        fits=fits,
        rank=rank,
    )


def request(*, model_id: str = "meta-llama/Meta-Llama-3-8B", gpu: str = "L4", target_batch: int = 16,
            seq_len: int = 1024, constraints: dict | None = None, fingerprint: str | None = None) -> PlanRequest:
    return PlanRequest(
        model_id=model_id,
        model_fingerprint=fingerprint or ("f" * 8 + model_id.encode().hex())[:64],
        gpu=gpu,
        gpu_count=1,
        gpu_memory_bytes=23034 * MiB,
        target_batch=target_batch,
        seq_len=seq_len,
        constraints={"method": "lora", "top_k": 3} if constraints is None else constraints,
        planner_version="0.1.0",
    )


def plan_result(*, req: PlanRequest | None = None, candidates: int = 3) -> PlanResult:
    req = req or request()
    # micro batches 4x4, 2x8, 1x16: all reach the target batch of 16
    plans = tuple(candidate(rank=i + 1, micro_batch=4 >> i, grad_accum=4 << i) for i in range(candidates))
    return PlanResult(
        request=req,
        plans=plans,
        rejected=(Rejection(family="full, bf16-mixed, adamw", reason="model states need 120 GiB > 21.6 GiB usable"),),
        searched=42,
        usable_bytes=22000 * MiB,
        safety_margin_bytes=1034 * MiB,
    )


def measurement(*, peak: int = 17_000_000_000, outcome: str = "ok", step_s: float | None = 3.5) -> Measurement:
    return Measurement(
        outcome=outcome,
        device="NVIDIA L4",
        peak_allocated_bytes=peak,
        peak_reserved_bytes=peak + 300 * MiB,
        process_total_bytes=peak + 700 * MiB,
        step_s=step_s,
        tokens_per_s=None if step_s is None else 16 * 1024 / step_s,
        library_versions={"torch": "2.13.0", "peft": "0.21.2"},
        node="gpu-node-1",
        started_at="2026-11-20T10:00:00+00:00",
        finished_at="2026-11-20T10:02:30+00:00",
        error=None if outcome == "ok" else "CUDA out of memory",
    )


# ---- databases -----------------------------------------------------------------------------
@functools.cache
def postgres_unavailable() -> str | None:
    """None when the test server answers, else why not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'oom-planner[postgres]')"
    from sqlalchemy.engine import make_url

    u = make_url(PG_SERVER_URL)
    try:
        psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database,
                        password=u.password, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {u.host}:{u.port or 5432} is not reachable ({str(exc).strip().splitlines()[0]})"
    return None


def require_postgres() -> None:
    reason = postgres_unavailable()
    if reason:
        if os.environ.get("PLANNER_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PLANNER_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def fresh_pg_schema():
    """A URL on the test server whose search_path is a fresh schema, dropped afterwards."""
    require_postgres()
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    schema = f"planner_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(PG_SERVER_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def pg_url():
    """A URL on the test server whose search_path is a fresh schema, dropped afterwards."""
    with fresh_pg_schema() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request):
    """Each test that takes it runs once on SQLite and once on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
