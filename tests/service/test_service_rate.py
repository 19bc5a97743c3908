"""The per-caller rate limit (issue 22, item 7's "no rate limit"): PLANNER_API_RATE_LIMIT
requests a minute per caller on /v1/..., a 429 with Retry-After past it, other callers and the
open pages untouched, and no limit when it is unset."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402

from planner.errors import PlannerError  # noqa: E402
from planner.service import create_app  # noqa: E402
from planner.service.ratelimit import MAX_CALLERS, RateLimiter  # noqa: E402
from planner.service.settings import RATE_LIMIT_ENV, ServiceSettings  # noqa: E402

WRITE, OTHER = "write-token-0123456789abcdef0123", "second-writer-token-0123456789abc"  # 32+ characters each


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_bucket_allows_a_burst_then_the_steady_rate():
    now = [100.0]
    limiter = RateLimiter(3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [None, None, None]
    assert limiter.take("a") == pytest.approx(20.0)  # 3 a minute: one more every 20 s
    assert limiter.take("b") is None  # another caller has its own bucket
    now[0] += 10.0
    assert limiter.take("a") == pytest.approx(10.0)  # half a request regained
    now[0] += 10.0
    assert limiter.take("a") is None
    now[0] += 3600.0  # a long pause refills to the burst, not beyond
    assert [limiter.take("a") for _ in range(4)][-1] == pytest.approx(20.0)


def test_the_limiter_forgets_the_least_recent_caller_past_its_bound():
    limiter = RateLimiter(1, clock=lambda: 0.0)
    for i in range(MAX_CALLERS + 5):
        limiter.take(f"c{i}")
    assert len(limiter.buckets) == MAX_CALLERS and "c0" not in limiter.buckets


def test_past_the_limit_a_caller_gets_429_with_retry_after_and_others_do_not(tmp_path, monkeypatch):
    # the app's limiter on a clock that stands still: on the real one a loaded machine let a second
    # pass between the first request and the refused one, and Retry-After said 29
    monkeypatch.setitem(RateLimiter.__init__.__kwdefaults__, "clock", lambda: 1000.0)
    settings = ServiceSettings(database_url=f"sqlite:///{tmp_path / 'p.db'}", token=f"{WRITE},{OTHER}",
                               rate_per_minute=2)
    with TestClient(create_app(settings)) as client:
        assert [client.get("/v1/plans", headers=bearer(WRITE)).status_code for _ in range(2)] == [200, 200]
        refused = client.get("/v1/plans", headers=bearer(WRITE))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "30"
        assert "2 requests a minute per caller" in refused.json()["error"] and WRITE not in refused.text
        assert client.get("/v1/plans", headers=bearer(OTHER)).status_code == 200
        assert client.get("/healthz").status_code == 200  # the open pages are not counted
        # callers without a known token share their address's bucket, whatever token they send
        assert [client.get("/v1/plans", headers=bearer(f"guess-{i}")).status_code for i in range(3)] == [200, 200, 429]


def test_no_limit_when_unset(tmp_path):
    with TestClient(create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'p.db'}"))) as client:
        assert {client.get("/v1/plans").status_code for _ in range(30)} == {200}


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(RATE_LIMIT_ENV, value)
    with pytest.raises(PlannerError, match=RATE_LIMIT_ENV):
        ServiceSettings.from_env()


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(RATE_LIMIT_ENV, "120")
    assert ServiceSettings.from_env().rate_per_minute == 120
