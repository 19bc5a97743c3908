"""The app's one store: opened at startup, shared by every request, closed at shutdown.

``Store`` methods each run in their own transaction on a pooled engine, so one instance serves
concurrent requests (the threadpool FastAPI runs sync routes in); SQLite's single writer is
handled by the store itself (``BEGIN IMMEDIATE`` plus retries while locked, see
``planner.store.engine``). A database that is down at startup does not stop the app: it answers
503 with the reason and opens the store on the first request that finds it back.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from planner.errors import StoreError

if TYPE_CHECKING:  # pragma: no cover
    from planner.store import Store

log = logging.getLogger("planner.service")


class StoreHolder:
    """Opens the store once (lazily again after a failure) and closes it on shutdown."""

    def __init__(self, *, url: str | None) -> None:
        self._url = url
        self._store: "Store | None" = None
        self._lock = threading.Lock()

    def open(self) -> None:
        """Open now; a failure is logged, not raised (requests retry and answer 503 meanwhile)."""
        try:
            self.get()
        except StoreError as exc:
            log.warning("plan store not available yet: %s", exc)

    def get(self) -> "Store":
        """The open store; ``StoreError`` (answered as 503) when the database cannot be opened."""
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is None:
                from planner.store import open_store

                self._store = open_store(url=self._url)
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


__all__ = ["StoreHolder"]
