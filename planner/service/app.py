"""The FastAPI app: routes, error handlers, the token and body-size guard, the web page."""

from __future__ import annotations

import functools
import hmac
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from planner.service.settings import TOKEN_ENV, ServiceSettings
from planner.service.state import StoreHolder

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: methods that never need the token nor carry a body worth reading
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: the page loads only its own script and style, and is never framed: whatever a stored plan
#: holds cannot run as script there (the script also writes server data as text only)
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def authorized(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time (hmac.compare_digest)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


class Guard:
    """ASGI middleware for every request that is not a read: the bearer token first (when the
    server has one), then the body size, both before any route parses the body."""

    def __init__(self, app: Any, *, token: str | None, max_body_bytes: int) -> None:
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.token is not None and not authorized(headers.get("authorization"), self.token):
            await _answer(scope, receive, send, 401, f"missing or wrong token: send 'Authorization: Bearer <token>' "
                                                     f"with the server's {TOKEN_ENV}", {"WWW-Authenticate": "Bearer"})
            return
        body = await self._read(headers.get("content-length"), receive)
        if body is None:
            await _answer(scope, receive, send, 413, f"request body over {self.max_body_bytes:,} bytes: send the "
                                                     "config.json alone, without weights or tokenizer files")
            return
        await self.app(scope, _replay(body), send)

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
                  headers: dict[str, str] | None = None) -> None:
    from fastapi.responses import JSONResponse

    await JSONResponse({"error": error}, status_code=status, headers=headers)(scope, receive, send)


@functools.cache
def index_html() -> str:
    from importlib import resources

    return resources.files("planner.service").joinpath("static", "index.html").read_text(encoding="utf-8")


def build_app(settings: ServiceSettings) -> "FastAPI":
    """The app for ``settings``; its store opens at startup and closes at shutdown."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse
    from fastapi.staticfiles import StaticFiles

    from planner import __version__
    from planner.service.errors import install_handlers
    from planner.service.routes import router

    holder = StoreHolder(url=settings.database_url)

    @asynccontextmanager
    async def lifespan(app: "FastAPI") -> AsyncIterator[None]:
        holder.open()
        try:
            yield
        finally:
            holder.close()

    app = FastAPI(title="OOM Planner", version=__version__, lifespan=lifespan,
                  description="Plan the fastest way to fine-tune a model on a GPU without running out of memory.")
    app.state.settings, app.state.holder = settings, holder
    app.add_middleware(Guard, token=settings.token, max_body_bytes=settings.max_body_bytes)
    install_handlers(app)
    app.include_router(router)
    app.mount("/static", StaticFiles(packages=[("planner.service", "static")]), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(index_html(), headers=PAGE_HEADERS)

    return app


__all__ = ["Guard", "authorized", "build_app"]
