"""The service's log lines never carry a secret: the tokens and the database URL's user part and
query values (``ServiceSettings.secrets``) are masked in every message and traceback, whoever
logs it (the planner, the store, uvicorn)."""

from __future__ import annotations

import logging
from typing import Any

from planner.store.engine import Secrets

#: the loggers whose records are masked where they are made; ``planner serve`` also puts the
#: filter on every handler (``log_config``), which sees the records of every logger
LOGGERS = ("planner", "planner.service", "planner.service.access", "planner.store", "uvicorn", "uvicorn.error",
           "uvicorn.access", "sqlalchemy")


class RedactSecrets(logging.Filter):
    """Masks ``secrets`` in a record's message and traceback (the record is changed, then passed)."""

    def __init__(self, secrets: Secrets | None = None) -> None:
        super().__init__()
        if secrets is None:  # made by logging.config from ``log_config``: the settings of the environment
            from planner.service.settings import ServiceSettings

            secrets = ServiceSettings.from_env().secrets
        self.secrets = secrets
        self._mask = secrets.scrub

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        masked = self._mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._mask(record.exc_text)
        return True


def redact_logs(secrets: Secrets) -> None:
    """Put one ``RedactSecrets`` on each of ``LOGGERS`` (replacing the one an earlier app put)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RedactSecrets)]:
            logger.removeFilter(old)
        logger.addFilter(RedactSecrets(secrets))


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging configuration with the planner's loggers added (its request log lines:
    who called, never the token) and ``RedactSecrets`` on every handler."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": "planner.service.logs.RedactSecrets"}}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact")
    config["loggers"]["planner"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


__all__ = ["LOGGERS", "RedactSecrets", "log_config", "redact_logs"]
