"""The planner over HTTP: a FastAPI app (``planner serve``) and its web page.

The routes parse JSON, call the same library functions as the CLI (``planner.planning``,
``planner.estimation``, ``planner.store``, ``planner.gpus``, ``planner.catalog``) and answer their
JSON forms; they decide nothing themselves. FastAPI is imported only when an app is made, so
importing this package (or ``planner --help``) loads nothing heavy::

    from planner.service import create_app
    app = create_app()   # settings from PLANNER_DATABASE_URL, PLANNER_API_TOKEN, PLANNER_API_READ_TOKEN, ...
                         # (planner.service.settings.ServiceSettings.from_env)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from planner.service.settings import ServiceSettings


def create_app(settings: "ServiceSettings | None" = None) -> "FastAPI":
    """The ASGI app; ``settings`` default to ``ServiceSettings.from_env()``."""
    from planner.service.app import build_app
    from planner.service.settings import ServiceSettings

    return build_app(settings or ServiceSettings.from_env())


__all__ = ["create_app"]
