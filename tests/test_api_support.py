"""A real ``planner serve`` for the tests that need one: a subprocess on 127.0.0.1 and a free
port, waited for through /healthz and stopped (by its pid) at the end."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(*, env: dict[str, str], log: Path) -> Iterator[str]:
    """Start ``python -m planner serve`` with ``env`` added; yields its base URL."""
    import httpx

    port = free_port()
    environment = os.environ | {"PYTHONPATH": str(ROOT)} | env
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "planner", "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=environment, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"planner serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"planner serve did not answer /healthz in {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class FakeSubmission:
    """What ``planner.verify.submit_verification`` answers: the plan and the Ray job."""

    plan_id: str
    job_id: str


def fake_verify(monkeypatch: Any, submit: Callable[..., Any]) -> list[dict[str, Any]]:
    """Replace ``planner.verify`` (the lead's Ray job submission) by ``submit``; returns the calls.

    The route imports ``planner.verify`` when it runs, so a stand-in module in ``sys.modules``
    takes its place whether or not the real one is there."""
    calls: list[dict[str, Any]] = []
    module = types.ModuleType("planner.verify")

    def submit_verification(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return submit(**kwargs)

    module.submit_verification = submit_verification  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "planner.verify", module)
    return calls
