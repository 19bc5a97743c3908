"""A per-caller rate limit for a shared service: a token bucket per caller.

A caller is its token's id (``settings.token_id``) or, without a known token, its client address,
so that one team member's script cannot take the service from the others. The bucket holds
``per_minute`` requests and refills continuously at ``per_minute / 60`` a second (the usual token
bucket: a burst of ``per_minute``, then the steady rate). It lives in each worker process: with N
uvicorn workers a caller may get up to N times the rate, which is what a limit without shared
state can promise (stated in the README).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable

#: Callers remembered per process; the least recently seen is forgotten first (a forgotten caller
#: starts again with a full bucket, the same as a new one), bounding the limiter's memory.
MAX_CALLERS = 10_000


class RateLimiter:
    """``take(caller)`` is None while the caller has a request left, else the seconds until it has."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self.clock = per_minute, clock
        self.rate = per_minute / 60.0  # requests regained per second
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (tokens, when)

    def take(self, caller: str) -> float | None:
        now = self.clock()
        tokens, then = self.buckets.pop(caller, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self.buckets[caller] = (tokens - 1.0, now)
            wait = None
        else:
            self.buckets[caller] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
        while len(self.buckets) > MAX_CALLERS:
            self.buckets.popitem(last=False)
        return wait

    def refusal(self, wait: float) -> tuple[str, dict[str, str]]:
        """The 429 line and its Retry-After header (whole seconds, rounded up)."""
        seconds = max(1, math.ceil(wait))
        return (f"rate limit: {self.per_minute} requests a minute per caller on this server; retry in {seconds} s "
                "(the operator sets PLANNER_API_RATE_LIMIT)"), {"Retry-After": str(seconds)}


__all__ = ["MAX_CALLERS", "RateLimiter"]
