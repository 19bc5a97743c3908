"""The FastAPI app: routes, error handlers, the guard (tokens, body size, query text, request
log, per-request budgets), the web page and the API's documentation page."""

from __future__ import annotations

import contextvars
import functools
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl

from planner.service.settings import READ_TOKEN_ENV, TOKEN_ENV, ServiceSettings, token_id
from planner.service.state import HealthProbe, StoreHolder
from planner.text import check_printable, visible

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

access_log = logging.getLogger("planner.service.access")

#: methods that never change anything nor carry a body worth reading
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: what anyone may read even when reads are protected: the page, its files, the documentation
#: page (the API's description itself, /openapi.json, is a read), and /healthz (which says only
#: ok/unavailable to a caller without a token)
_OPEN_PATHS = frozenset({"/", "/docs", "/healthz", "/favicon.ico"})
_OPEN_PREFIXES = ("/static/",)
#: the page loads only its own script and style, and is never framed: whatever a stored plan
#: holds cannot run as script there (the script also writes server data as text only)
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
#: who is calling, for the request log and /healthz: a token id (``token_id``), "anonymous"
#: (no token sent), or "invalid-token" (one the server does not know, on an open route)
ANONYMOUS, INVALID = "anonymous", "invalid-token"


def authorized(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time (hmac.compare_digest)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def caller_scope(header: str | None, settings: ServiceSettings) -> tuple[str, str | None]:
    """(who, scope) of a request: the token's id and "write" or "read", ANONYMOUS or INVALID and
    None. Every token is compared (in constant time), so the time says nothing of which matched."""
    if not header:
        return ANONYMOUS, None
    found: tuple[str, str | None] = (INVALID, None)
    for scope, tokens in (("read", settings.read_tokens), ("write", settings.write_tokens)):
        for token in tokens:
            if authorized(header, token):
                found = (token_id(token), scope)
    return found


class Guard:
    """ASGI middleware in front of every request: who calls (the bearer token), whether that
    caller may (writes need a write token when the server has one; reads need a read or a write
    token when it has read tokens), the body size before any route parses the body, query
    parameters as printable text, the request log line, and the per-request budgets and database
    timeouts the routes run under."""

    def __init__(self, app: Any, *, settings: ServiceSettings, budgets: Any = None) -> None:
        from planner.service.ratelimit import RateLimiter

        self.app, self.settings, self.budgets = app, settings, budgets
        self.max_body_bytes = settings.max_body_bytes
        self.limiter = RateLimiter(settings.rate_per_minute) if settings.rate_per_minute else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        who, rights = caller_scope(headers.get("authorization"), self.settings)

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, logged_send, headers, who, rights)
        finally:
            path = scope.get("path", "")
            query = scope.get("query_string", b"").decode("latin-1")
            access_log.info("%s %s -> %d in %.0f ms by %s", scope.get("method", "?"),
                            visible(path + ("?" + query if query else "")), status[0],
                            (time.perf_counter() - start) * 1000, who)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], who: str,
                       rights: str | None) -> None:
        method, path = scope["method"], scope.get("path", "")
        if self.limiter is not None and path.startswith("/v1/"):
            # a known token is its caller; anyone else is counted by address (an invalid token
            # must not buy a fresh bucket per guess)
            caller = who if rights is not None else "addr:" + str((scope.get("client") or ("?",))[0])
            wait = self.limiter.take(caller)
            if wait is not None:
                line, retry = self.limiter.refusal(wait)
                await _answer(scope, receive, send, 429, line, retry)
                return
        refused = self._refusal(method, path, who, rights)
        if refused is not None:
            await _answer(scope, receive, send, 401, refused, {"WWW-Authenticate": "Bearer"})
            return
        bad_query = _bad_query(scope.get("query_string", b""))
        if bad_query is not None:
            await _answer(scope, receive, send, 422, bad_query[1], field=bad_query[0])
            return
        if method not in _SAFE_METHODS:
            body = await self._read(headers.get("content-length"), receive)
            if body is None:
                await _answer(scope, receive, send, 413, f"request body over {self.max_body_bytes:,} bytes: send "
                                                         "the config.json alone, without weights or tokenizer files")
                return
            receive = _replay(body)
        from planner.service import budget
        from planner.store import deadlines

        tokens = (budget.CURRENT.set(self.budgets), CALLER.set((who, rights)))
        try:
            with deadlines.using(self.settings.db_timeouts):
                await self.app(scope, receive, send)
        finally:
            CALLER.reset(tokens[1])
            budget.CURRENT.reset(tokens[0])

    def _refusal(self, method: str, path: str, who: str, rights: str | None) -> str | None:
        """Why this caller may not make this request (the 401 line), or None."""
        settings = self.settings
        if method not in _SAFE_METHODS:
            if settings.write_tokens and rights != "write":
                return (f"missing or wrong token: send 'Authorization: Bearer <token>' with a token of the server's "
                        f"{TOKEN_ENV}" + (" (a read token cannot write)" if rights == "read" else ""))
            return None
        if not settings.reads_protected or path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES):
            return None
        if rights is None:
            return (f"missing or wrong token: reads on this server need 'Authorization: Bearer <token>' with a token "
                    f"of its {READ_TOKEN_ENV} or {TOKEN_ENV}")
        return None

    async def _read(self, declared: str | None, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it is (or is declared) larger than the limit."""
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_body_bytes):
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


#: (who, scope) of the request being answered (``caller_scope``)
CALLER: contextvars.ContextVar[tuple[str, str | None]] = contextvars.ContextVar("planner_caller",
                                                                               default=(ANONYMOUS, None))


def _bad_query(raw: bytes) -> tuple[str, str] | None:
    """(field, line) of the first query parameter that is not printable text (a NUL byte reached
    PostgreSQL and came back as a 503), or None."""
    try:
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8", errors="replace")
    except ValueError:
        return "query", "the query string does not parse: write name=value pairs joined by &"
    for name, value in pairs:
        for text, what in ((name, "a query parameter's name"), (value, name)):
            problem = check_printable(text, what=visible(what))
            if problem is not None:
                return visible(name), problem
    return None


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, error: str,
                  headers: dict[str, str] | None = None, *, field: str | None = None) -> None:
    from fastapi.responses import JSONResponse

    body = {"error": error} | ({"field": field} if field else {})
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


@functools.cache
def static_text(name: str) -> str:
    from importlib import resources

    return resources.files("planner.service").joinpath("static", name).read_text(encoding="utf-8")


def index_html() -> str:
    return static_text("index.html")


def _stop_on_exit_signals(budgets: Any, seconds: float) -> None:
    """Wrap the server's SIGTERM/SIGINT handlers (uvicorn's, installed before the app starts) so that the
    requests still running are stopped within ``seconds`` of the signal, the graceful timeout the server
    waits (``Budgets.stop_after``): half a second before it (half of it at most), so that they answer 503
    themselves before the server cancels them. Only the main thread may set handlers: an app run
    elsewhere (a test client's thread) is left to its server."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if not callable(previous):
            continue

        def on_exit(number: int, frame: Any, previous: Callable[..., Any] = previous) -> None:
            budgets.stop_after(max(seconds - 0.5, seconds / 2))
            previous(number, frame)

        signal.signal(signum, on_exit)


def build_app(settings: ServiceSettings) -> "FastAPI":
    """The app for ``settings``; its store opens in the background at startup and closes at shutdown."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from fastapi.staticfiles import StaticFiles

    from planner import __version__
    from planner.service.budget import Budgets
    from planner.service.errors import install_handlers
    from planner.service.logs import redact_logs
    from planner.service.routes import router

    holder = StoreHolder(url=settings.store_url(), timeouts=settings.db_timeouts)
    probe = HealthProbe(holder)
    budgets = Budgets(cpu_s=settings.cpu_budget_s, memory_bytes=settings.memory_budget_bytes)
    redact_logs(settings.secrets)

    @asynccontextmanager
    async def lifespan(app: "FastAPI") -> AsyncIterator[None]:
        from planner.planning import warm

        # the planning modules and the catalog: the first request's CPU budget is its own work. Before
        # the store's opener starts: two threads importing (compiling) at once is where CPython 3.11's
        # AST converter, whose recursion depth is per interpreter, can raise a SystemError
        warm()
        if settings.graceful_timeout_s is not None:
            _stop_on_exit_signals(budgets, settings.graceful_timeout_s)
        holder.open()  # in the background: the server binds and answers while the database is down or hung
        try:
            yield
        finally:
            stopped = budgets.stop_all()
            if stopped:
                logging.getLogger("planner.service").warning("shutdown: stopped %d request(s) still running", stopped)
            holder.close()

    # FastAPI's own /docs and /redoc load their scripts from a CDN: /docs here is the package's page
    app = FastAPI(title="OOM Planner", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Plan the fastest way to fine-tune a model on a GPU without running out of memory.")
    app.state.settings, app.state.holder, app.state.budgets = settings, holder, budgets
    app.add_middleware(Guard, settings=settings, budgets=budgets)
    install_handlers(app)
    app.include_router(router)
    app.mount("/static", StaticFiles(packages=[("planner.service", "static")]), name="static")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(index_html(), headers=PAGE_HEADERS)

    @app.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(static_text("docs.html"), headers=PAGE_HEADERS)

    @app.api_route("/favicon.ico", methods=["GET", "HEAD"], include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)  # none: browsers ask for it, a 404 would be logged as an error

    @app.head("/healthz", include_in_schema=False)
    @app.get("/healthz", tags=["service"],
             responses={503: {"description": "The database cannot be reached (or does not answer in 2 s)."}})
    async def healthz() -> Any:
        """Whether the service can reach its database: ``{"status": "ok"}`` or 503 ``{"status":
        "unavailable"}``; with a token of the server (when it has any), also why and how many
        plans it holds. Answers within 2 s whatever the database does."""
        health = await probe.check()
        _, rights = CALLER.get()
        details = rights is not None or not settings.write_tokens
        if health.ok:
            body = {"status": "ok"} | ({"database": "ok", "plans": health.plans} if details else {})
            return JSONResponse(body)
        body = {"status": "unavailable"} | ({"database": health.reason} if details else {})
        return JSONResponse(body, status_code=503)

    return app


__all__ = ["CALLER", "Guard", "authorized", "build_app", "caller_scope"]
