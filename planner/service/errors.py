"""How failures become HTTP answers: one line in ``{"error": ...}``, never a traceback.

- the planner's ``PlannerError`` (a user mistake) -> 422, naming the request field when the line
  names its CLI option; ``NothingFitsError`` -> 422 with every family's closest try, exactly as
  ``planner suggest --json`` prints it;
- an unknown plan id -> 404, an ambiguous id prefix -> 400;
- the database or the Ray cluster unreachable -> 503 with the reason, and so is a database that
  does not answer in time (the pool's wait, the statement timeout: ``planner.store.deadlines``);
  a missing extra -> 501;
- request validation (types, missing fields) -> 422 with each field and the reason;
- anything else -> a logged traceback and a plain 500 (a bug to fix, not an answer).

No answer carries a secret: every error line is passed through ``scrub`` with the server's
tokens and its database URL's user part and query values (``ServiceSettings.secrets``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any

from planner.errors import (
    AmbiguousIdError,
    ClusterUnavailableError,
    JobNotFoundError,
    MissingDependencyError,
    ModelConfigError,
    NothingFitsError,
    PlannerError,
    RecordNotFoundError,
    StoreError,
    UnknownGPUError,
    UnknownModelError,
    UnstorableDataError,
)
from planner.service.calls import INLINE_SOURCE

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI, Request

log = logging.getLogger("planner.service")

_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")
#: the field an error is about when its line names no option
_FIELD_OF = ((UnknownGPUError, "gpu"), (UnknownModelError, "model"), (ModelConfigError, "config"))


class ServiceError(Exception):
    """A failure of the service itself (not of the request's content), with its status."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


#: error kind -> HTTP status, most specific first (an unknown id 404, an ambiguous prefix 400, data
#: the store refuses to keep 422, any other store failure is the database failing: 503)
_STATUS_OF = (
    (RecordNotFoundError, 404), (AmbiguousIdError, 400), (UnstorableDataError, 422), (StoreError, 503),
    (MissingDependencyError, 501), (ClusterUnavailableError, 503), (JobNotFoundError, 404),
)


def status_for(exc: PlannerError) -> int:
    """The HTTP status of a planner error (422 for every other user mistake)."""
    return next((status for kind, status in _STATUS_OF if isinstance(exc, kind)), 422)


@functools.cache
def _fields() -> frozenset[str]:
    """Every request field name: body fields and the query parameters (history's filters and
    pages, a candidate's rank), so that a line naming ``--rank`` or ``--gpus-max`` names the field."""
    from planner.service.check_body import CheckBody
    from planner.service.schemas import CompareBody, EstimateBody, PlanBody

    bodies = frozenset().union(*(body.model_fields for body in (PlanBody, EstimateBody, CompareBody, CheckBody)))
    return bodies | {"since", "status", "limit", "offset", "after", "rank", "search"}


def in_api_terms(message: str) -> tuple[str, str | None]:
    """The library's line with its CLI options written as the request's fields
    (``--seq-len 9000`` -> ``seq_len 9000``), and the first field it names."""
    named: list[str] = []

    def field(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        if name not in _fields():
            return match.group(0)
        named.append(name)
        return name

    return _OPTION.sub(field, message), (named[0] if named else None)


def planner_error_body(exc: PlannerError) -> dict[str, Any]:
    """``{"error": line}``, plus ``field`` when the line names one, and every family's closest
    try when nothing fits."""
    message, field = in_api_terms(str(exc))
    if message.startswith(f"{INLINE_SOURCE}: "):  # the library names a config by its source
        message, field = f"config: {message[len(INLINE_SOURCE) + 2:]}", field or "config"
    if isinstance(exc, NothingFitsError) and exc.result is not None:
        return exc.result.to_dict() | {"plan_id": None, "error": message}  # as planner suggest --json
    body: dict[str, Any] = {"error": message}
    lead = message.split(": ", 1)[0]  # a line about a body field may start with its name ("prices: ...")
    field = field or (lead if lead in _fields() else None)
    field = field or next((name for kind, name in _FIELD_OF if isinstance(exc, kind)), None)
    if field and status_for(exc) == 422:
        body["field"] = field
    return body


_SEND = "send one JSON object with Content-Type: application/json"
#: FastAPI's detail for a body whose parse raised something other than a JSON decode error
#: (fastapi 0.165.0 routing.py l.514, get_request_handler: a RecursionError on deep nesting)
_UNPARSED = "There was an error parsing the body"


def _field_and_reason(error: dict[str, Any]) -> tuple[str, str]:
    """One pydantic error as (field, reason). A body that does not parse is located at the
    character offset (("body", 12)): that is no field, and "JSON decode error" does not say what
    to send."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error")
        where = f" ({detail} at character {loc[-1]})" if detail and loc else ""
        return "body", f"the body is not valid JSON{where}: {_SEND}"
    if error.get("type") == "missing" and loc == ("body",):
        return "body", f"the body is empty: {_SEND}"
    if loc == ("body",) and error.get("type") in ("model_attributes_type", "dict_type"):
        # a list, null, or a body sent without the JSON content type (FastAPI then reads it as bytes)
        return "body", f"the body is not a JSON object: {_SEND}"
    names = [str(part) for part in loc if part not in ("body", "query", "path")]
    return ".".join(names) or "body", str(error.get("msg", "invalid"))


def validation_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """422 body of a request that does not parse: every field with the reason, and one line."""
    fields = [dict(zip(("field", "reason"), _field_and_reason(error))) for error in errors]
    line = "; ".join(f"{f['field']}: {f['reason']}" for f in fields) or "invalid request"
    return {"error": line, "field": fields[0]["field"] if fields else "body", "errors": fields}


def database_busy(exc: BaseException, request: "Request") -> str:
    """The 503 line of an SQLAlchemy error no store method wrapped: the pool's wait for a free
    connection ran out (TimeoutError), or the driver failed outside a transaction."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    from planner.store.engine import db_failure

    settings = request.app.state.settings
    if isinstance(exc, PoolTimeout):
        return (f"the database did not answer in time: all its connections stayed busy for "
                f"{settings.db_timeouts.pool_s:g} s (it is slow, hung or overloaded); retry in a moment")
    return str(db_failure(settings.database_url or "database", exc))


def install_handlers(app: "FastAPI") -> None:
    """Register the handlers above on ``app``."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from sqlalchemy.exc import SQLAlchemyError
    from starlette.exceptions import HTTPException

    secrets = app.state.settings.secrets

    def answer(body: dict[str, Any], status: int, headers: dict[str, str] | None = None) -> "JSONResponse":
        if secrets and isinstance(body.get("error"), str):
            body = body | {"error": secrets.scrub(body["error"])}
        return JSONResponse(body, status_code=status, headers=headers)

    def planner_error(request: "Request", exc: PlannerError) -> "JSONResponse":
        return answer(planner_error_body(exc), status_for(exc))

    def service_error(request: "Request", exc: ServiceError) -> "JSONResponse":
        return answer({"error": str(exc)}, exc.status, exc.headers)

    def database_error(request: "Request", exc: SQLAlchemyError) -> "JSONResponse":
        log.warning("database error answering %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return answer({"error": database_busy(exc, request)}, 503)

    def invalid(request: "Request", exc: RequestValidationError) -> "JSONResponse":
        return answer(validation_body(list(exc.errors())), 422)

    def http_error(request: "Request", exc: HTTPException) -> "JSONResponse":
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _UNPARSED:  # FastAPI's line for a body json.loads gave up on
            detail = f"the body could not be read as JSON (nested too deeply, or not JSON): {_SEND}"
        return answer({"error": detail}, exc.status_code, exc.headers)

    def unexpected(request: "Request", exc: Exception) -> "JSONResponse":
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse({"error": "internal error: the server logged it; please report it"}, status_code=500)

    app.add_exception_handler(PlannerError, planner_error)
    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


__all__ = ["ServiceError", "install_handlers", "planner_error_body", "status_for", "validation_body"]
