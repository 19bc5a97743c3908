"""A real ``planner serve`` for the tests that need one: a subprocess on 127.0.0.1 and a free
port, waited for through /healthz and stopped (by its pid) at the end."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(*, env: dict[str, str], log: Path, ready: tuple[int, ...] = (200,), args: tuple[str, ...] = (),
                   log_level: str = "warning", procs: list | None = None) -> Iterator[str]:
    """Start ``python -m planner serve`` with ``env`` added (and ``args``); yields its base URL once
    /healthz answers one of ``ready`` (503 too: a server whose database is down is up).
    ``procs`` receives the server's Popen."""
    import httpx

    port = free_port()
    environment = os.environ | {"PYTHONPATH": str(ROOT)} | env
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "planner", "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
             log_level, *args],
            env=environment, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"planner serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code in ready:
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
    """What ``planner.verify.jobs.submit_plan`` answers: the plan and the Ray job."""

    plan_id: str
    job_id: str


def fake_verify(monkeypatch: Any, submit: Callable[..., Any]) -> list[dict[str, Any]]:
    """Replace ``planner.verify.jobs.submit_plan`` (stores the plan and submits its Ray job) by
    ``submit``, called with what the job was asked (address, database_url, verify_top, steps,
    model, result); returns those calls. Nothing is stored: ``submit`` answers the plan id."""
    import planner.verify.jobs as jobs

    calls: list[dict[str, Any]] = []

    def submit_plan(job: Any, *, reference: Any, store: Any, result: Any, model: str) -> Any:
        asked = {"address": job.address, "database_url": job.database_url, "verify_top": job.options.top,
                 "steps": job.options.steps, "model": model, "result": result}
        calls.append(asked)
        return submit(**asked)

    monkeypatch.setattr(jobs, "submit_plan", submit_plan)
    return calls


# ---- databases that fail: a port that never answers, a proxy that hangs ----------------------------
class _Listener:
    """A TCP port on 127.0.0.1 whose accepted connections go to ``_take``, in a thread of its own."""

    def __init__(self) -> None:
        import threading

        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(256)
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()


class SilentPort(_Listener):
    """A TCP port on 127.0.0.1 that accepts every connection and never sends a byte: a database
    that is hung (or a firewall that swallows packets after the handshake)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []
        super().__init__()

    def _take(self, conn: socket.socket) -> None:
        self._held.append(conn)  # held open, never read, never answered

    def close(self) -> None:
        super().close()
        for conn in self._held:
            conn.close()


class FreezableProxy(_Listener):
    """A TCP proxy on 127.0.0.1 in front of a real database. ``freeze()``: every connection stays
    open and nothing is relayed any more, new connections are accepted and left unanswered (the
    database hangs mid-run); ``thaw()``: relaying resumes and new connections reach the database;
    ``cut()``: every connection through it is closed (connections terminated)."""

    def __init__(self, host: str, port: int) -> None:
        import threading

        self._upstream = (host, port)
        self._thawed = threading.Event()
        self._thawed.set()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        super().__init__()

    def _take(self, conn: socket.socket) -> None:
        import threading

        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def freeze(self) -> None:
        self._thawed.clear()

    def upstream_ports(self) -> list[int]:
        """The local ports of the proxy's connections to the database (its backends' client_port)."""
        with self._lock:
            return [upstream.getsockname()[1] for _, upstream in self._pairs if upstream.fileno() >= 0]

    def thaw(self) -> None:
        self._thawed.set()

    def cut(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _serve(self, client: socket.socket) -> None:
        import threading

        self._thawed.wait()  # frozen: accepted, never answered
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._pairs.append((client, upstream))
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        import select

        try:
            while True:
                self._thawed.wait()
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready or not self._thawed.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        super().close()
        self.thaw()
        self.cut()


def url_through(url: str, port: int) -> str:
    """``url`` (a PostgreSQL URL) with its host and port replaced by 127.0.0.1:``port``."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
