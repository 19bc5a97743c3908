"""What the service is configured with: read once from the environment, never from a request."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.errors import PlannerError
from planner.store.deadlines import TIMEOUT_ENVS, Timeouts

if TYPE_CHECKING:  # pragma: no cover
    from planner.store.engine import Secrets

#: Bearer token(s) with every right: POSTs, and reads when reads are protected. Unset: the API is
#: open, as on a laptop. Several tokens, comma-separated: one per person or service, each named
#: in the request log by its id (``token_id``) and revoked by removing it.
TOKEN_ENV = "PLANNER_API_TOKEN"
#: Bearer token(s) that may only read (GET /v1/..., /openapi.json, /healthz's details). Set, every
#: read needs a read or a write token; unset, reads are open.
READ_TOKEN_ENV = "PLANNER_API_READ_TOKEN"
#: Ray dashboard address ``"verify": true`` submits to, e.g. http://ray-head:8265.
RAY_ADDRESS_ENV = "PLANNER_RAY_ADDRESS"
#: The store's URL (the same variable the CLI reads).
DATABASE_URL_ENV = "PLANNER_DATABASE_URL"
#: Or a file holding it (a mounted secret): verification jobs are then given its path, never the
#: URL (``planner.verify.jobs``), and a URL with a password can be verified with.
DATABASE_URL_FILE_ENV = "PLANNER_DATABASE_URL_FILE"
#: Per-request budgets: CPU seconds of the thread that answers, and growth of the process's memory.
CPU_BUDGET_ENV = "PLANNER_API_CPU_SECONDS"
MEMORY_BUDGET_ENV = "PLANNER_API_MEMORY"
#: Requests a minute each caller (token, or client address without one) may make to /v1/...;
#: unset: no limit (``planner.service.ratelimit``).
RATE_LIMIT_ENV = "PLANNER_API_RATE_LIMIT"
#: seconds ``planner serve --graceful-timeout`` gives running requests after SIGTERM (it sets this for its workers)
GRACEFUL_TIMEOUT_ENV = "PLANNER_GRACEFUL_TIMEOUT"
#: Seconds the service waits for its database (``planner.store.deadlines.Timeouts``), by field.
DB_TIMEOUT_ENVS = TIMEOUT_ENVS

#: Largest request body read (bytes). A real config.json is 0.5-5 KiB (the catalog's largest is
#: under 4 KiB); 256 KiB leaves room for long id2label maps while bounding what one request can
#: make the server hold.
MAX_BODY_BYTES = 256 * 1024
#: Largest inline config.json, as compact JSON (bytes); checked by ``planner.service.schemas``.
MAX_CONFIG_BYTES = 128 * 1024
#: Default CPU budget of one request. planner.limits bounds a plan's work before it starts (the
#: worst request inside those bounds takes about 1 s of CPU on the 2-core CI machine, and the
#: slowest catalog request 2 s: the re-ranking after the allocator replay refuses plans); this
#: is the backstop for what those bounds cannot see.
CPU_BUDGET_S = 10.0
#: Default memory budget of one request: how much the server process may grow while it runs
#: (the worst request inside planner.limits' bounds grows it by about 150 MB).
MEMORY_BUDGET_BYTES = 1024**3


def token_id(token: str) -> str:
    """How a token is named in logs: the first 8 hex digits of its SHA-256 (never the token;
    4 bytes of a hash do not help guess it, and tell a team's tokens apart)."""
    return "tok-" + hashlib.sha256(token.encode()).hexdigest()[:8]


#: The shortest token accepted: 32 characters, 16 random bytes written in hex (``openssl rand -hex 16``,
#: Python's ``secrets.token_hex(16)``), 128 bits, the least OWASP ASVS 5.0 asks of a reference token
#: (requirement 7.2.3: "at least 128 bits of entropy", from a CSPRNG). A length cannot show randomness;
#: it refuses the passwords ("changeme", "admin123") a bearer token must not be.
MIN_TOKEN_CHARS = 32


def _tokens(value: str | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    tokens = tuple(part.strip() for part in value.split(","))
    if not all(tokens):
        raise PlannerError(f"{name} is set but empty (or holds an empty item between commas): unset it, or set "
                           "real tokens, e.g. $(openssl rand -hex 32), comma-separated for several")
    short = [position for position, token in enumerate(tokens, 1) if len(token) < MIN_TOKEN_CHARS]
    if short:  # never the token itself, nor its length: where it is in the list
        where = f"token {short[0]} of {len(tokens)}" if len(tokens) > 1 else "its token"
        raise PlannerError(f"{name}: {where} is shorter than {MIN_TOKEN_CHARS} characters, too short to be a secret "
                           f"(128 random bits, OWASP ASVS 7.2.3): set e.g. $(openssl rand -hex 32)")
    return tokens


@dataclass(frozen=True, kw_only=True)
class ServiceSettings:
    """The service's configuration."""

    database_url: str | None = None
    """Store URL; None: the CLI's default (``$PLANNER_DATABASE_URL`` or the local SQLite file)."""
    database_url_file: str | None = None
    """Path of a file holding the store URL (instead of ``database_url``); a verification job is
    given this path, which the Ray head must mount at the same place."""
    token: str | None = None
    """Write token(s), comma-separated: required on every POST (and they read too); None: writes are open."""
    read_token: str | None = None
    """Read-only token(s), comma-separated: when set, every read needs a read or a write token."""
    ray_address: str | None = None
    """Ray dashboard (job submission) address for ``"verify": true``; None: verification is off."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Request bodies above this are refused with 413 before they are parsed."""
    cpu_budget_s: float = CPU_BUDGET_S
    """CPU seconds one request may use (422 past it)."""
    memory_budget_bytes: int = MEMORY_BUDGET_BYTES
    """Bytes the process may grow by while one request runs (413 past it)."""
    db_timeouts: Timeouts = field(default_factory=Timeouts)
    """How long the service waits for its database (``planner.store.deadlines``)."""
    rate_per_minute: int | None = None
    """Requests a minute per caller on /v1/... (429 past it); None: no limit."""
    graceful_timeout_s: float | None = None
    """Seconds the server gives running requests after SIGTERM/SIGINT before it stops them (``planner serve
    --graceful-timeout``); None: the app was not started by ``planner serve`` and leaves them to its server."""

    def __post_init__(self) -> None:
        if self.database_url and self.database_url_file:
            raise PlannerError(f"both {DATABASE_URL_ENV} and {DATABASE_URL_FILE_ENV} are set: unset one of them")
        writers = _tokens(self.token, TOKEN_ENV)
        readers = _tokens(self.read_token, READ_TOKEN_ENV)
        if readers and not writers:
            raise PlannerError(f"{READ_TOKEN_ENV} is set without {TOKEN_ENV}: reads would be protected and writes "
                               f"open; set {TOKEN_ENV} too")
        object.__setattr__(self, "_writers", writers)
        object.__setattr__(self, "_readers", readers)
        value = self.max_body_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 2 * MAX_CONFIG_BYTES:
            raise PlannerError(f"max_body_bytes must be a whole number >= {2 * MAX_CONFIG_BYTES} "
                               f"(room for an inline config), got {value!r}")
        cpu = self.cpu_budget_s
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0.1 <= cpu <= 3600:
            raise PlannerError(f"{CPU_BUDGET_ENV} must be a number of seconds from 0.1 to 3600, got {cpu!r}")
        memory = self.memory_budget_bytes
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 64 * 1024**2:
            raise PlannerError(f"{MEMORY_BUDGET_ENV} must be at least 64MiB, got {memory!r}")
        rate = self.rate_per_minute
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= 1_000_000):
            raise PlannerError(f"{RATE_LIMIT_ENV} must be a whole number of requests a minute from 1 to 1000000 "
                               f"(unset for no limit), got {rate!r}")

    @property
    def write_tokens(self) -> tuple[str, ...]:
        return self._writers  # type: ignore[attr-defined]

    @property
    def read_tokens(self) -> tuple[str, ...]:
        return self._readers  # type: ignore[attr-defined]

    @property
    def reads_protected(self) -> bool:
        return bool(self.read_tokens)

    def store_url(self) -> str | None:
        """The store's URL: ``database_url``, or what the file ``database_url_file`` holds (read
        now: a secret rotated in place is picked up by the next app); None: the CLI's default."""
        if self.database_url_file:
            from planner.store.engine import read_url_file

            return read_url_file(self.database_url_file)
        return self.database_url

    @property
    def secrets(self) -> "Secrets":
        """What must never be printed: the tokens, and the database URL's user part and query
        values (``planner.store.engine.url_secrets``)."""
        from planner.store.engine import Secrets, default_database_url, url_secrets

        try:
            url = self.store_url() or os.environ.get(DATABASE_URL_ENV) or None
        except PlannerError:
            url = None
        if url is None:
            try:
                url = default_database_url()
            except PlannerError:
                url = None
        return Secrets(credentials=(*self.write_tokens, *self.read_tokens)) + url_secrets(url)

    @classmethod
    def from_env(cls) -> "ServiceSettings":
        """From ``PLANNER_DATABASE_URL`` (or ``PLANNER_DATABASE_URL_FILE``), ``PLANNER_API_TOKEN``, ``PLANNER_API_READ_TOKEN``,
        ``PLANNER_RAY_ADDRESS``, ``PLANNER_API_CPU_SECONDS``, ``PLANNER_API_MEMORY`` and
        ``PLANNER_DB_CONNECT_TIMEOUT`` / ``_STATEMENT_TIMEOUT`` / ``_POOL_TIMEOUT``."""

        def env(name: str) -> str | None:
            value = os.environ.get(name)
            return value if value is None or value.strip() or name in (TOKEN_ENV, READ_TOKEN_ENV) else None

        def seconds(name: str) -> float | None:
            value = env(name)
            try:
                return None if value is None else float(value)
            except ValueError:
                raise PlannerError(f"{name} {value!r} is not a number of seconds: write e.g. 10") from None

        budgets: dict[str, object] = {}
        if (cpu := seconds(CPU_BUDGET_ENV)) is not None:
            budgets["cpu_budget_s"] = cpu
        waits = {field: value for field, name in DB_TIMEOUT_ENVS.items() if (value := seconds(name)) is not None}
        if waits:
            try:
                budgets["db_timeouts"] = Timeouts(**waits)
            except ValueError as exc:
                raise PlannerError(f"{' / '.join(DB_TIMEOUT_ENVS.values())}: {exc}") from None
        rate = env(RATE_LIMIT_ENV)
        if rate is not None:
            if not rate.strip().isdigit():
                raise PlannerError(f"{RATE_LIMIT_ENV} {rate!r} is not a whole number of requests a minute: write "
                                   "e.g. 120, or unset it for no limit")
            budgets["rate_per_minute"] = int(rate)
        if (graceful := seconds(GRACEFUL_TIMEOUT_ENV)) is not None:
            budgets["graceful_timeout_s"] = graceful
        memory = env(MEMORY_BUDGET_ENV)
        if memory is not None:
            from planner.units import parse_bytes

            budgets["memory_budget_bytes"] = parse_bytes(memory, option=MEMORY_BUDGET_ENV)
        return cls(database_url=env(DATABASE_URL_ENV), database_url_file=env(DATABASE_URL_FILE_ENV), token=env(TOKEN_ENV), read_token=env(READ_TOKEN_ENV),
                   ray_address=env(RAY_ADDRESS_ENV), **budgets)


__all__ = ["CPU_BUDGET_ENV", "GRACEFUL_TIMEOUT_ENV", "DATABASE_URL_ENV", "DATABASE_URL_FILE_ENV", "DB_TIMEOUT_ENVS", "MAX_BODY_BYTES", "MAX_CONFIG_BYTES", "MEMORY_BUDGET_ENV", "MIN_TOKEN_CHARS",
           "RATE_LIMIT_ENV", "READ_TOKEN_ENV", "RAY_ADDRESS_ENV", "ServiceSettings", "TOKEN_ENV", "token_id"]
