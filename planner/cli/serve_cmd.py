"""``planner serve``: the HTTP API and web page (``planner.service``) under uvicorn."""

from __future__ import annotations

import errno
from typing import Optional

import typer

from planner.cli.store import DB_HELP

#: How long a stopping server lets running requests finish: a request's CPU budget (10 s by default)
#: bounds how long one may run anyway.
GRACEFUL_TIMEOUT_S = 10


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface, as in a container)."),
    port: int = typer.Option(8000, "--port", "-p", help="TCP port (1-65535)."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="Ray dashboard for \"verify\": true, e.g. http://ray-head:8265 (default: $PLANNER_RAY_ADDRESS)."
    ),
    workers: int = typer.Option(
        1, "--workers", "-w", help="Server processes: a search is CPU-bound and holds the GIL, so one per core scales it."
    ),
    log_level: str = typer.Option("info", "--log-level", help="critical|error|warning|info|debug (info: one line per request, with the caller's token id)."),
    graceful_timeout: int = typer.Option(
        GRACEFUL_TIMEOUT_S, "--graceful-timeout",
        help="Seconds a stopping server (SIGTERM, Ctrl-C) lets running requests finish before it stops them (1-600).",
    ),
) -> None:
    """Serve the planner over HTTP: the JSON API (documented at /docs) and the web page at /.

    Every POST needs 'Authorization: Bearer <token>' when PLANNER_API_TOKEN is set, and every read when
    PLANNER_API_READ_TOKEN is set (both in the environment, never on the command line). The server binds
    at once and opens its database in the background: /healthz answers while the database is down."""
    import os

    from planner.errors import MissingDependencyError, PlannerError

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise MissingDependencyError(
            f"planner serve needs the service extra ({exc.name} is missing): pip install 'oom-planner[service]'"
        ) from None
    # one line each, in the words of the other option errors
    if not 1 <= port <= 65535:
        raise PlannerError(f"--port {port} is not a TCP port: use 1-65535, e.g. 8000")
    if not 1 <= workers <= 64:
        raise PlannerError(f"--workers {workers} is out of range: use 1-64, about one per CPU core")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        raise PlannerError(f"--log-level {log_level!r} is not a level: use critical|error|warning|info|debug")
    if not 1 <= graceful_timeout <= 600:
        raise PlannerError(f"--graceful-timeout {graceful_timeout} is out of range: use 1-600 seconds, e.g. 10")
    from planner.service.settings import DATABASE_URL_ENV, GRACEFUL_TIMEOUT_ENV, RAY_ADDRESS_ENV, ServiceSettings

    # every server process builds its app from the environment (uvicorn imports the factory in
    # each worker), so the options go there; the settings are checked once here, before binding
    os.environ[GRACEFUL_TIMEOUT_ENV] = str(graceful_timeout)  # the app stops what still runs then (budget.py)
    for name, value in ((DATABASE_URL_ENV, db), (RAY_ADDRESS_ENV, ray_address)):
        if value is not None:
            os.environ[name] = value
    settings = ServiceSettings.from_env()
    _check_listen(host, port)
    if settings.token is None and host not in ("127.0.0.1", "localhost", "::1"):
        from planner.cli._common import console_to_stderr

        console_to_stderr().print(f"warning: PLANNER_API_TOKEN is not set: anyone who reaches {host}:{port} can "
                                  "plan and submit verification jobs", markup=False)
    from planner.service.logs import log_config

    # the planner logs one line per request (who called: the token's id); uvicorn's own access
    # log would repeat it without the caller. Past the graceful timeout uvicorn cancels what is
    # left and the app's shutdown stops the requests still running (planner.service.budget).
    options = dict(host=host, port=port, log_level=log_level, log_config=log_config(log_level), access_log=False,
                   timeout_graceful_shutdown=graceful_timeout)
    if workers == 1:
        from planner.service import create_app

        uvicorn.run(create_app(), **options)
    else:
        uvicorn.run("planner.service:create_app", factory=True, workers=workers, **options)


def _check_listen(host: str, port: int) -> None:
    """One line, exit 2, for an address this machine cannot listen on (a port in use, a host name
    that does not resolve or is not this machine's), before uvicorn logs it and exits 3, the code
    that means "nothing fits" elsewhere. A bind and close: a race with another process is left to
    uvicorn, as before."""
    import socket

    from planner.errors import PlannerError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PlannerError(f"--host {host!r} is not an address of this machine ({exc.strerror}): give one, e.g. "
                           "127.0.0.1, or 0.0.0.0 for every interface") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds (a TIME_WAIT port is free)
        try:
            sock.bind(address)
        except OSError as exc:
            fix = ("stop what listens there, or give another --port" if exc.errno == errno.EADDRINUSE
                   else "give an address of this machine, e.g. 127.0.0.1" if exc.errno == errno.EADDRNOTAVAIL
                   else "give another --host or --port (ports below 1024 need privileges)")
            raise PlannerError(f"cannot listen on {host}:{port} ({exc.strerror}): {fix}") from None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
