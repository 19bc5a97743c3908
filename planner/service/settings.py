"""What the service is configured with: read once from the environment, never from a request."""

from __future__ import annotations

import os
from dataclasses import dataclass

from planner.errors import PlannerError

#: Bearer token every POST needs when set (unset: the API is open, as on a laptop).
TOKEN_ENV = "PLANNER_API_TOKEN"
#: Ray dashboard address ``"verify": true`` submits to, e.g. http://ray-head:8265.
RAY_ADDRESS_ENV = "PLANNER_RAY_ADDRESS"
#: The store's URL (the same variable the CLI reads).
DATABASE_URL_ENV = "PLANNER_DATABASE_URL"

#: Largest request body read (bytes). A real config.json is 0.5-5 KiB (the catalog's largest is
#: under 4 KiB); 256 KiB leaves room for long id2label maps while bounding what one request can
#: make the server hold.
MAX_BODY_BYTES = 256 * 1024
#: Largest inline config.json, as compact JSON (bytes); checked by ``planner.service.schemas``.
MAX_CONFIG_BYTES = 128 * 1024


@dataclass(frozen=True, kw_only=True)
class ServiceSettings:
    """The service's configuration."""

    database_url: str | None = None
    """Store URL; None: the CLI's default (``$PLANNER_DATABASE_URL`` or the local SQLite file)."""
    token: str | None = None
    """Bearer token required on every POST; None: writes are open."""
    ray_address: str | None = None
    """Ray dashboard (job submission) address for ``"verify": true``; None: verification is off."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Request bodies above this are refused with 413 before they are parsed."""

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise PlannerError(f"{TOKEN_ENV} is set but empty: unset it for an open API or set a real token")
        value = self.max_body_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 2 * MAX_CONFIG_BYTES:
            raise PlannerError(f"max_body_bytes must be a whole number >= {2 * MAX_CONFIG_BYTES} "
                               f"(room for an inline config), got {value!r}")

    @classmethod
    def from_env(cls) -> "ServiceSettings":
        """From ``PLANNER_DATABASE_URL``, ``PLANNER_API_TOKEN`` and ``PLANNER_RAY_ADDRESS``."""

        def env(name: str) -> str | None:
            value = os.environ.get(name)
            return value if value is None or value.strip() or name == TOKEN_ENV else None

        return cls(database_url=env(DATABASE_URL_ENV), token=env(TOKEN_ENV), ray_address=env(RAY_ADDRESS_ENV))


__all__ = ["DATABASE_URL_ENV", "MAX_BODY_BYTES", "MAX_CONFIG_BYTES", "RAY_ADDRESS_ENV", "ServiceSettings",
           "TOKEN_ENV"]
